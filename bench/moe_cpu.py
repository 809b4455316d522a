"""CPU benchmark of a Mixtral (MoE) checkpoint: batchinfer's ``LLM`` vs transformers ``generate``.

A tiny random Mixtral written by transformers (tests/moe_models.py: hidden 256, 4 layers, 8
experts, top-2, ~17M parameters, float32), the same greedy ``ignore_eos`` workload for both;
transformers runs padded static batches (bench/engine_cpu.py's rules: arrival order, left
padding, only the tokens each request asked for count). The engine's MoE layers run the ``cpu``
backend of ``kernels.moe.fused_moe`` (tokens grouped by expert); transformers' run its per-expert loop.

    python bench/moe_cpu.py --threads 1           # the full run (a few minutes)
    python bench/moe_cpu.py --quick               # a smoke version (seconds)

The last line printed is one JSON object: tokens_per_s, transformers_tokens_per_s, ratio.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from engine_cpu import run_transformers, workload

from batchinfer import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from moe_models import make_tiny_moe_model  # noqa: E402

MODEL = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 4, "num_local_experts": 8, "num_experts_per_tok": 2,
         "max_position_embeddings": 1024}
FULL = {"requests": 64, "prompt": (16, 256), "output": (16, 128), "hf_batch": 16}
QUICK = {"requests": 8, "prompt": (8, 48), "output": (4, 16), "hf_batch": 4}


def run_engine(model_dir: Path, prompts, outputs) -> tuple[float, int]:
    llm = LLM(model_dir, max_num_seqs=256, max_num_batched_tokens=2048, num_kv_blocks=4096)
    llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4), use_tqdm=False)  # warm up
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in outputs]
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == sum(outputs)
    return wall, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small smoke version (seconds)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    w = QUICK if args.quick else FULL
    prompts, outputs = workload(w["requests"], w["prompt"], w["output"])
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_moe_model(Path(tmp) / "mixtral", "MixtralForCausalLM", **MODEL)
        params = sum(t.numel() for t in LLM(model_dir, num_kv_blocks=1).engine.model.parameters())
        print(f"model: Mixtral {params / 1e6:.1f}M parameters (8 experts, top-2), float32, "
              f"{torch.get_num_threads()} threads")
        print(f"workload: {len(prompts)} requests, prompts {w['prompt']}, outputs {w['output']}, "
              f"{sum(map(len, prompts))} prompt and {sum(outputs)} output tokens")
        wall, tokens = run_engine(model_dir, prompts, outputs)
        engine_tps = tokens / wall
        print(f"batchinfer LLM:   {wall:8.1f} s  {engine_tps:8.1f} output tokens/s")
        hf_wall, hf_tokens = run_transformers(model_dir, prompts, outputs, w["hf_batch"])
        hf_tps = hf_tokens / hf_wall
        print(f"transformers:     {hf_wall:8.1f} s  {hf_tps:8.1f} output tokens/s  "
              f"(static batches of {w['hf_batch']})")
        print(f"ratio: {engine_tps / hf_tps:.2f}x")
    print(json.dumps({"tokens_per_s": round(engine_tps, 2), "transformers_tokens_per_s": round(hf_tps, 2),
                      "ratio": round(engine_tps / hf_tps, 3)}))


if __name__ == "__main__":
    main()
