"""CPU benchmark of the engine: batchinfer's ``LLM`` vs transformers ``generate``, in one run.

The same tiny random Llama (~20M parameters, float32) and workload for both: 256 requests with
prompts of 32-512 tokens and 32-256 output tokens each, greedy, ``ignore_eos``. transformers runs
them in padded static batches of 32 (arrival order, left padding, each batch generating until its
longest request is done); only the tokens each request asked for are counted.

Engine efficiency = engine tokens/s / tokens/s of bare model forwards at the same tokens per step:
every 4th step is replayed through ``Decoder.forward`` + ``compute_logits`` alone (same inputs),
and efficiency is bare time / engine step time over those steps, i.e. the share of the step loop
spent running the model rather than scheduling, building inputs, sampling and detokenising.

On a machine shared with other work, ``--threads 1`` gives steadier figures: OpenMP threads that
wait at barriers for a descheduled sibling make multi-threaded timings swing by 10x.

    python bench/engine_cpu.py            # the full run (minutes)
    python bench/engine_cpu.py --quick    # a small smoke version
    python bench/engine_cpu.py --model demo               # SmolLM2-135M-Instruct (its GGUF file)
    python bench/engine_cpu.py --model PATH               # any HF folder or .gguf file

With ``--model``, both sides load that checkpoint in float32 (transformers a GGUF file through
``from_pretrained(folder, gguf_file=...)``, which dequantizes it); the workload stays token ids
below 300, valid in any vocabulary.

The last line printed is one JSON object: tokens_per_s, transformers_tokens_per_s, ratio, efficiency.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from batchinfer import LLM, SamplingParams
from batchinfer.workers.testing import demo_gguf, make_tiny_model

MODEL = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 6, "num_attention_heads": 8,
         "num_key_value_heads": 4, "max_position_embeddings": 1024}
FULL = {"requests": 256, "prompt": (32, 512), "output": (32, 256), "hf_batch": 32}
QUICK = {"requests": 32, "prompt": (16, 128), "output": (8, 48), "hf_batch": 8}


def workload(n: int, prompt: tuple[int, int], output: tuple[int, int], seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(0, 300) for _ in range(rng.randint(*prompt))] for _ in range(n)]
    outputs = [rng.randint(*output) for _ in range(n)]
    return prompts, outputs


def run_engine(model_dir: Path, prompts, outputs, replay_every: int) -> tuple[float, int, float, dict]:
    """Wall time and tokens of ``LLM.generate``, and the engine efficiency.

    Every ``replay_every``-th step is replayed through the bare model right after it ran (same
    inputs, same cache: it rewrites identical K/V), so both timings see the same machine load;
    the replays are left out of the engine's wall time.
    """
    llm = LLM(model_dir, max_num_seqs=256, max_num_batched_tokens=2048, num_kv_blocks=8192)
    engine, runner = llm.engine, llm.engine.runner
    # Warm up (first-call allocations) with a small request.
    llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4), use_tqdm=False)

    prepare, step = runner.prepare, engine.step
    timing = {"steps": 0, "bare": 0.0, "engine": 0.0}
    recorded = []

    def recording_prepare(scheduled):
        inputs = prepare(scheduled)
        if timing["steps"] % replay_every == 0:
            recorded.append(inputs)
        return inputs

    def timed_step():
        t0 = time.perf_counter()
        out = step()
        elapsed = time.perf_counter() - t0
        timing["steps"] += 1
        if recorded:
            inputs = recorded.pop()
            t0 = time.perf_counter()
            with torch.inference_mode():
                hidden = runner.model(inputs.input_ids, inputs.positions, runner.kv_caches,
                                      inputs.attn_metadata)
                runner.model.compute_logits(hidden[inputs.sample_indices])
            timing["bare"] += time.perf_counter() - t0
            timing["engine"] += elapsed
        return out

    runner.prepare, engine.step = recording_prepare, timed_step
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in outputs]
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0 - timing["bare"]
    runner.prepare, engine.step = prepare, step
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == sum(outputs)
    stats = {"steps": timing["steps"], "preemptions": engine.num_preemptions,
             "tokens_per_step": engine.num_computed_tokens / max(1, engine.num_steps)}
    return wall, tokens, timing["bare"] / timing["engine"], stats


def load_transformers(model: Path):
    import transformers

    if model.suffix.lower() == ".gguf":
        return transformers.AutoModelForCausalLM.from_pretrained(model.parent, gguf_file=model.name,
                                                                 dtype=torch.float32).eval()
    return transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()


def run_transformers(model_dir: Path, prompts, outputs, batch: int) -> tuple[float, int]:
    hf = load_transformers(model_dir)
    tokens = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            group, wants = prompts[i:i + batch], outputs[i:i + batch]
            width = max(len(p) for p in group)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in group])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=max(wants), do_sample=False,
                              eos_token_id=None, pad_token_id=0)
            assert out.shape[1] == width + max(wants)
            tokens += sum(wants)  # the padding-generated extra tokens do not count
    return time.perf_counter() - t0, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small smoke version (seconds)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--model", default=None,
                    help="HF folder or .gguf file, or 'demo' (SmolLM2-135M-Instruct) [a random ~20M Llama]")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    w = QUICK if args.quick else FULL
    prompts, outputs = workload(w["requests"], w["prompt"], w["output"])
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            model_dir = make_tiny_model(Path(tmp) / "llama-20m", "LlamaForCausalLM", **MODEL)
        else:
            model_dir = demo_gguf() if args.model == "demo" else Path(args.model)
        model = LLM(model_dir, num_kv_blocks=1).engine.model
        params = sum(t.numel() for t in model.parameters())
        print(f"model: {model_dir.name}, {model.config.architecture} {params / 1e6:.1f}M parameters, "
              f"float32, {torch.get_num_threads()} threads")
        print(f"workload: {len(prompts)} requests, prompts {w['prompt']}, outputs {w['output']}, "
              f"{sum(map(len, prompts))} prompt and {sum(outputs)} output tokens")
        wall, tokens, efficiency, stats = run_engine(model_dir, prompts, outputs, replay_every=4)
        engine_tps = tokens / wall
        print(f"batchinfer LLM:   {wall:8.1f} s  {engine_tps:8.1f} output tokens/s  "
              f"({stats['steps']} steps, {stats['tokens_per_step']:.0f} tokens/step, "
              f"{stats['preemptions']} preemptions)")
        hf_wall, hf_tokens = run_transformers(model_dir, prompts, outputs, w["hf_batch"])
        hf_tps = hf_tokens / hf_wall
        print(f"transformers:     {hf_wall:8.1f} s  {hf_tps:8.1f} output tokens/s  "
              f"(static batches of {w['hf_batch']})")
        print(f"ratio: {engine_tps / hf_tps:.2f}x   engine efficiency: {efficiency:.2f}")
    print(json.dumps({"tokens_per_s": round(engine_tps, 2), "transformers_tokens_per_s": round(hf_tps, 2),
                      "ratio": round(engine_tps / hf_tps, 3), "efficiency": round(efficiency, 3)}))


if __name__ == "__main__":
    main()
