"""GPU check of the engine: tokens against transformers on CUDA, then throughput of a
Qwen3-0.6B-shaped random model in bfloat16 against transformers ``generate``, in one run.

1. Correctness: tiny random Llama / Qwen3 checkpoints in float32 (TF32 off), 16 mixed-length
   prompts, greedy, through ``LLM(device="cuda")`` with each available attention backend
   (triton, flash when importable) and through transformers; the tokens must be identical.
2. Throughput: a Qwen3-0.6B-shaped random checkpoint (28 layers, hidden 1024, 16 / 8 heads,
   head_dim 128, vocab 151936) in bfloat16; the engine workload of bench/engine_cpu.py (256
   requests, prompts 32-512, outputs 32-256, greedy, ``ignore_eos``) through ``LLM`` (CUDA
   graphs for decode) and through transformers ``generate`` in padded static batches of 32.

    python bench/engine_gpu.py [--requests 256] [--json PATH]

Prints one table last; exits 1 when a token check fails, 2 without CUDA.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from engine_cpu import workload  # bench/ is this script's folder, first on sys.path

from batchinfer import LLM, SamplingParams
from batchinfer.kernels import available_backends
from batchinfer.workers.models.tiny import make_tiny_model

QWEN3_0_6B = {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
              "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
              "vocab_size": 151936, "max_position_embeddings": 4096, "tie_word_embeddings": True,
              "torch_dtype": "bfloat16"}


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_tokens: int,
              dtype: torch.dtype) -> list[list[int]]:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()
    out = []
    with torch.inference_mode():
        for p in prompts:  # one at a time: no padding effects in the reference
            ids = torch.tensor([p], device="cuda")
            gen = hf.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
            out.append(gen[0, len(p):].tolist())
    del hf
    torch.cuda.empty_cache()
    return out


def check_tokens(tmp: Path) -> list[tuple[str, str, bool, str]]:
    """Greedy tokens of each backend vs transformers, float32, on tiny checkpoints."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    prompts, _ = workload(16, (3, 200), (1, 2), seed=1)
    rows = []
    for arch in ("LlamaForCausalLM", "Qwen3ForCausalLM"):
        model_dir = make_tiny_model(tmp / arch, arch, max_position_embeddings=512)
        expected = hf_greedy(model_dir, prompts, 24, torch.float32)
        for backend in [b for b in ("triton", "flash") if b in available_backends("cuda")]:
            # 1 GiB of KV: the check needs little, and an LLM of the process still holding its
            # cache (gpu_memory_utilization of the device by default) would leave the next none.
            llm = LLM(model_dir, dtype="float32", device="cuda", max_num_batched_tokens=256,
                      attention_backend=backend, kv_cache_memory=1 << 30)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
            got = [o.outputs[0].token_ids for o in outs]
            same = sum(g == e for g, e in zip(got, expected, strict=True))
            rows.append((arch, backend, same == len(prompts), f"{same}/{len(prompts)} prompts identical"))
            del llm
            torch.cuda.empty_cache()
    return rows


def throughput(tmp: Path, requests: int) -> dict:
    prompts, outputs = workload(requests, (32, 512), (32, 256))
    model_dir = make_tiny_model(tmp / "qwen3-0.6b", "Qwen3ForCausalLM", **QWEN3_0_6B)
    llm = LLM(model_dir, dtype="bfloat16", device="cuda", max_num_batched_tokens=8192, max_num_seqs=256)
    llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4), use_tqdm=False)  # warm up
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    del llm
    torch.cuda.empty_cache()

    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    hf_tokens, batch = 0, 32
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            group, wants = prompts[i:i + batch], outputs[i:i + batch]
            width = max(len(p) for p in group)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in group], device="cuda")
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group], device="cuda")
            hf.generate(ids, attention_mask=mask, max_new_tokens=max(wants), do_sample=False,
                        eos_token_id=None, pad_token_id=0)
            hf_tokens += sum(wants)
    torch.cuda.synchronize()
    hf_wall = time.perf_counter() - t1
    return {"requests": requests, "tokens": tokens, "engine_s": wall, "engine_tokens_per_s": tokens / wall,
            "transformers_s": hf_wall, "transformers_tokens_per_s": hf_tokens / hf_wall,
            "ratio": (tokens / wall) / (hf_tokens / hf_wall)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("engine_gpu: no CUDA device; this check runs on a GPU machine (bench/gpu_check.sh)")
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        checks = check_tokens(Path(tmp))
        for arch, backend, ok, detail in checks:
            print(f"tokens {arch:18s} {backend:7s} {'ok' if ok else 'MISMATCH'}  {detail}")
        figures = throughput(Path(tmp), args.requests)
    ok = all(c[2] for c in checks)
    print("== engine (GPU) ==")
    print(f"{'check':40s} {'result':>30s}")
    for arch, backend, passed, detail in checks:
        verdict = ("ok " if passed else "FAIL ") + detail
        print(f"{'greedy tokens ' + arch + ' / ' + backend:40s} {verdict:>30s}")
    print(f"{'batchinfer LLM, Qwen3-0.6B shape bf16':40s} {figures['engine_tokens_per_s']:>22.0f} tok/s")
    print(f"{'transformers generate, batches of 32':40s} {figures['transformers_tokens_per_s']:>22.0f} tok/s")
    print(f"{'ratio':40s} {figures['ratio']:>28.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"checks": checks, **figures}, indent=1))
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
