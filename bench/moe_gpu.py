"""GPU check of ``fused_moe``: the Triton grouped GEMM against the reference on Mixtral-8x7B's MoE layer.

Shape: hidden 4096, intermediate 14336, 8 experts, top-2, bfloat16 (2.8 GB of expert weights).
For each batch size (decode 1/16/64/256 tokens, prefill 1024/4096): correctness of every
available backend against the reference (``atol=rtol=2e-2``), then the median time of
``--iters`` launches (CUDA events) of each, with the achieved bandwidth over the expert weights
the batch touches (decode: weight reads dominate) and TFLOP/s (prefill), and the ratio to the
reference (torch: one expert at a time, cuBLAS matmuls). Prints one table last (its header starts
with ``== ``). Exit status: 0 when every correctness row passes, 1 when one fails, 2 without CUDA.
``--dry-run`` runs the script on CPU with tiny shapes (Triton under its interpreter).

    python bench/moe_gpu.py [--dry-run] [--iters N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

if "--dry-run" in sys.argv[1:]:  # before anything imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

from batchinfer.kernels.moe import available_backends, fused_moe

FULL = {"hidden": 4096, "inter": 14336, "experts": 8, "top_k": 2, "tokens": (1, 16, 64, 256, 1024, 4096)}
DRY = {"hidden": 64, "inter": 96, "experts": 4, "top_k": 2, "tokens": (1, 8, 40)}


def median_us(fns: list[Callable[[], object]], iters: int, cuda: bool) -> float:
    """Median duration of the calls in microseconds (inputs rotate between calls)."""
    for fn in fns:
        fn()
    times = []
    for i in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fns[i % len(fns)]()
            end.record()
            times.append((start, end))
        else:
            t0 = time.perf_counter()
            fns[i % len(fns)]()
            times.append(time.perf_counter() - t0)
    if cuda:
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in times) * 1e3
    return statistics.median(times) * 1e6


def run(shape: dict, device: torch.device, iters: int) -> list[dict]:
    C, I, E, K = shape["hidden"], shape["inter"], shape["experts"], shape["top_k"]
    dtype = torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    w13 = torch.randn(E, 2 * I, C, device=device, dtype=dtype, generator=gen) / C**0.5
    w2 = torch.randn(E, C, I, device=device, dtype=dtype, generator=gen) / I**0.5
    backends = [b for b in available_backends(device, dtype) if b != "reference"]
    if device.type == "cpu":
        backends = ["triton"]  # the dry run exercises the kernel under the interpreter
    rows = []
    for T in shape["tokens"]:
        inputs = [(torch.randn(T, C, device=device, dtype=dtype, generator=gen),
                   torch.randn(T, E, device=device, dtype=dtype, generator=gen)) for _ in range(3)]
        chosen = torch.cat([r.float().topk(K, -1).indices.flatten() for _, r in inputs])
        touched = torch.unique(chosen).numel()
        weight_bytes = min(touched, E) * 3 * C * I * 2  # expert weights one call reads (at most)
        flops = 2 * T * K * 3 * C * I
        ref_out = fused_moe(*inputs[0], w13, w2, K, backend="reference").float()
        ref_us = median_us([lambda h=h, r=r: fused_moe(h, r, w13, w2, K, backend="reference")
                            for h, r in inputs], iters, device.type == "cuda")
        rows.append({"tokens": T, "backend": "reference", "time_us": ref_us, "err": 0.0, "status": "",
                     "gbps": weight_bytes / ref_us / 1e3, "tflops": flops / ref_us / 1e6, "vs_ref": 1.0})
        for name in backends:
            out = fused_moe(*inputs[0], w13, w2, K, backend=name).float()
            err = (out - ref_out).abs().max().item()
            ok = torch.allclose(out, ref_out, atol=2e-2, rtol=2e-2)
            us = median_us([lambda h=h, r=r, name=name: fused_moe(h, r, w13, w2, K, backend=name)
                            for h, r in inputs], iters, device.type == "cuda")
            rows.append({"tokens": T, "backend": name, "time_us": us, "err": err,
                         "status": "PASS" if ok else "FAIL", "gbps": weight_bytes / us / 1e3,
                         "tflops": flops / us / 1e6, "vs_ref": ref_us / us})
        timed = ", ".join(f"{r['backend']} {r['time_us']:.0f} us" for r in rows if r["tokens"] == T)
        print(f"tokens {T}: {timed}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU: test the script itself")
    parser.add_argument("--iters", type=int, default=None, help="timed launches per row (default 50; 2 dry)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("moe_gpu: CUDA is not available; run this on a GPU machine, or pass --dry-run", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.dry_run else "cuda")
    shape = DRY if args.dry_run else FULL
    print(f"moe_gpu: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu (dry run)'}, "
          f"hidden {shape['hidden']}, intermediate {shape['inter']}, {shape['experts']} experts, "
          f"top-{shape['top_k']}, bfloat16", flush=True)
    rows = run(shape, device, args.iters or (2 if args.dry_run else 50))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    print(f"== {'tokens':>6} {'backend':<10} {'time us':>10} {'weights GB/s':>12} {'TFLOP/s':>8} "
          f"{'x ref':>6} {'max err':>8} status")
    for r in rows:
        print(f"   {r['tokens']:>6} {r['backend']:<10} {r['time_us']:>10.1f} {r['gbps']:>12.0f} "
              f"{r['tflops']:>8.1f} {r['vs_ref']:>6.2f} {r['err']:>8.4f} {r['status']}")
    return 1 if any(r["status"] == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
