"""LoRA adapters per request on the CPU: the same requests on 8 adapters and on the base model.

    .venv/bin/python -P bench/lora_cpu.py            # 256 requests, 8 adapters of rank 16
    .venv/bin/python -P bench/lora_cpu.py --quick    # 64 requests
    python -P bench/lora_cpu.py --device cuda --quick  # bench/gpu_check.sh
    python -P bench/lora_cpu.py --kernel-table         # CUDA: add_lora per backend (bench/gpu_check.sh)

One random Llama-shaped checkpoint (hidden 512, 4 layers, float32) and 8 random PEFT adapters of
rank 16 on all seven projections (q, k, v, o, gate, up, down). The same greedy requests (prompts
of 32-96 tokens, 32 generated, eos ignored) run through one engine: every request on the base
model, then request i on adapter i % 8 (all 8 resident: ``max_loras=8``), alternating
``--repeats`` times (3) so that both sides see the same machine load. Printed: tokens/s of each
side's best run and their ratio (LoRA / base: what mixing adapters into a step costs; the median
ratio of the pairs too), plus the ratio FLOPs alone allow (the adapters' rank-16 matmuls on top
of the base's).

``--kernel-table`` times the ``add_lora`` kernel alone instead (CUDA): one qkv_proj-shaped step of
Llama-3-8B (in 4096, out 4096/1024/1024) on 8 adapters of rank <= 16 in bfloat16, a quarter of the
tokens on the base, for triton, the torch (cpu) path and the reference, with the base qkv matmul
of the same step for scale; each backend's output is checked against the reference first.

The last line is one JSON object. ``-P``: the repository's ``kernels/`` folder must not shadow the
package transformers probes.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from batchinfer.workers.engine.engine import Engine
from batchinfer.workers.engine_config import EngineConfig
from batchinfer.workers.models.tiny import make_tiny_model
from batchinfer.workers.sampling_params import SamplingParams

MODEL = {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 4, "max_position_embeddings": 1024}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(path: Path, rank: int, seed: int) -> Path:
    """A random PEFT LoRA folder for ``MODEL`` (B nonzero: a zero B would change nothing)."""
    c = MODEL
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    shapes = {"q_proj": (c["hidden_size"], c["num_attention_heads"] * head_dim),
              "k_proj": (c["hidden_size"], c["num_key_value_heads"] * head_dim),
              "v_proj": (c["hidden_size"], c["num_key_value_heads"] * head_dim),
              "o_proj": (c["num_attention_heads"] * head_dim, c["hidden_size"]),
              "gate_proj": (c["hidden_size"], c["intermediate_size"]),
              "up_proj": (c["hidden_size"], c["intermediate_size"]),
              "down_proj": (c["intermediate_size"], c["hidden_size"])}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(c["num_hidden_layers"]):
        for name in TARGETS:
            fan_in, fan_out = shapes[name]
            part = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * fan_in ** -0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.02
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
              "bias": "none", "use_rslora": False, "use_dora": False, "modules_to_save": None,
              "fan_in_fan_out": False, "task_type": "CAUSAL_LM"}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def run(engine: Engine, prompts: list[list[int]], loras: list[str | None],
        max_tokens: int) -> dict[str, Any]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    began = time.perf_counter()
    steps = engine.num_steps
    for i, (p, lora) in enumerate(zip(prompts, loras, strict=True)):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", prompt_token_ids=p, sampling_params=params,
                           lora=lora)
    tokens = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
    seconds = time.perf_counter() - began
    return {"seconds": round(seconds, 3), "tokens": tokens, "tokens_per_s": round(tokens / seconds, 1),
            "steps": engine.num_steps - steps}


def flops_ratio(rank: int) -> float:
    """(base + adapter) / base matmul FLOPs per token of the decoder layers (LM head excluded)."""
    c = MODEL
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    q, kv, h, inter = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim, \
        c["hidden_size"], c["intermediate_size"]
    pairs = [(h, q), (h, kv), (h, kv), (q, h), (h, inter), (h, inter), (inter, h)]
    base = sum(i * o for i, o in pairs)
    extra = sum(rank * (i + o) for i, o in pairs)
    return base / (base + extra)


QKV_OUT = (4096, 1024, 1024)  # Llama-3-8B's q, k, v projections
SLOT_RANKS = (16, 8, 16, 4, 16, 16, 12, 16)  # 8 adapters, max rank 16 (the rest zero-padded)


def _qkv_step(num_tokens: int, seed: int) -> tuple[Any, ...]:
    """(y, x, a, bs, mapping) of one bfloat16 step on CUDA; a quarter of the tokens on the base."""
    import numpy as np

    from batchinfer.kernels.lora import LoRAMapping

    rank, in_features, dev, dtype = 16, 4096, "cuda", torch.bfloat16
    rng = np.random.default_rng(seed)
    slots = rng.integers(0, len(SLOT_RANKS), size=num_tokens)
    slots[rng.random(num_tokens) < 0.25] = -1
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(len(SLOT_RANKS), len(QKV_OUT) * rank, in_features, generator=g) / in_features**0.5
    bs = [torch.randn(len(SLOT_RANKS), out, rank, generator=g) for out in QKV_OUT]
    for slot, r in enumerate(SLOT_RANKS):
        a[slot].view(len(QKV_OUT), rank, in_features)[:, r:] = 0
        for b in bs:
            b[slot, :, r:] = 0
    x = torch.randn(num_tokens, in_features, generator=g).to(dev, dtype)
    y = torch.randn(num_tokens, sum(QKV_OUT), generator=g).to(dev, dtype)
    mapping = LoRAMapping.build(slots, SLOT_RANKS, dev)
    assert mapping is not None
    return y, x, a.to(dev, dtype), [b.to(dev, dtype) for b in bs], mapping


def _cuda_ms(fn: Any, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e3


def kernel_table() -> None:
    """The ``== lora`` table of ``add_lora`` per backend (see the module docstring), then its JSON."""
    import functools

    from batchinfer.kernels.lora import add_lora

    if not torch.cuda.is_available():
        raise SystemExit("--kernel-table needs CUDA")
    rows = []
    for num_tokens in (16, 2048):
        y, x, a, bs, mapping = _qkv_step(num_tokens, seed=3)
        ref = add_lora(y.clone(), x, a, bs, mapping, backend="reference")
        for backend in ("triton", "cpu"):
            out = add_lora(y.clone(), x, a, bs, mapping, backend=backend)
            torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2, msg=lambda m, b=backend: f"{b}: {m}")
        w = torch.randn(sum(QKV_OUT), 4096, device="cuda", dtype=torch.bfloat16)
        times = {name: _cuda_ms(functools.partial(add_lora, y, x, a, bs, mapping, backend=name),
                                iters=5 if name == "reference" else 50)
                 for name in ("triton", "cpu", "reference")}
        times["base matmul"] = _cuda_ms(functools.partial(torch.nn.functional.linear, x, w), iters=50)
        rows.append((num_tokens, times))
    print("== lora: add_lora, qkv_proj of Llama-3-8B (in 4096, out 4096/1024/1024), 8 adapters R=16, bf16")
    print(f"{'tokens':>7} {'triton ms':>10} {'torch ms':>10} {'reference ms':>13} {'base mm ms':>11} "
          f"{'vs torch':>9}")
    for num_tokens, t in rows:
        print(f"{num_tokens:>7} {t['triton']:>10.3f} {t['cpu']:>10.3f} {t['reference']:>13.3f} "
              f"{t['base matmul']:>11.3f} {t['cpu'] / t['triton']:>8.2f}x")
    print(json.dumps({"bench": "lora_kernel", "device": torch.cuda.get_device_name(),
                      "ms": {str(n): {k: round(v, 4) for k, v in t.items()} for n, t in rows}}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch threads on the CPU (default: torch's)")
    ap.add_argument("--repeats", type=int, default=3, help="base / LoRA pairs run (best of each reported)")
    ap.add_argument("--quick", action="store_true", help="64 requests")
    ap.add_argument("--kernel-table", action="store_true", help="time add_lora per backend instead (CUDA)")
    args = ap.parse_args()
    if args.kernel_table:
        kernel_table()
        return
    if args.quick:
        args.requests = 64
    if args.threads:
        torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = make_tiny_model(root / "base", **MODEL)
        adapters = {f"a{i}": str(write_adapter(root / f"a{i}", args.rank, seed=i))
                    for i in range(args.adapters)}
        engine = Engine(EngineConfig(model=str(model), device=args.device, max_num_seqs=256,
                                     max_num_batched_tokens=2048, num_kv_blocks=2048, lora_modules=adapters,
                                     max_loras=args.adapters, max_lora_rank=args.rank))
        vocab = engine.model.config.vocab_size
        lengths = torch.randint(32, 97, (args.requests,), generator=g).tolist()
        prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
        names = list(adapters)
        run(engine, prompts[:8], [names[i % len(names)] for i in range(8)], 4)  # warm every adapter's slot
        picks = [names[i % len(names)] for i in range(len(prompts))]
        pairs = [(run(engine, prompts, [None] * len(prompts), args.max_tokens),
                  run(engine, prompts, picks, args.max_tokens)) for _ in range(args.repeats)]
    base = max((b for b, _ in pairs), key=lambda r: r["tokens_per_s"])
    lora = max((lo for _, lo in pairs), key=lambda r: r["tokens_per_s"])
    ratio = lora["tokens_per_s"] / base["tokens_per_s"]
    pair_ratios = sorted(lo["tokens_per_s"] / b["tokens_per_s"] for b, lo in pairs)
    median = pair_ratios[len(pair_ratios) // 2]
    print(f"base model:            {base['tokens_per_s']:8.1f} tokens/s "
          f"({base['seconds']} s, {base['steps']} steps)")
    print(f"{args.adapters} adapters, rank {args.rank}: {lora['tokens_per_s']:8.1f} tokens/s "
          f"({lora['seconds']} s, {lora['steps']} steps)")
    print(f"throughput ratio LoRA / base: {ratio:.3f} best of {args.repeats}, {median:.3f} median pair "
          f"(FLOPs alone would allow {flops_ratio(args.rank):.3f}; target >= 0.8 on the 2-core CPU)")
    print(json.dumps({"bench": "lora_cpu", "device": args.device, "requests": args.requests,
                      "adapters": args.adapters, "rank": args.rank, "threads": torch.get_num_threads(),
                      "base": base, "lora": lora, "ratio": round(ratio, 3),
                      "median_pair_ratio": round(median, 3),
                      "flops_ratio": round(flops_ratio(args.rank), 3)}))


if __name__ == "__main__":
    main()
