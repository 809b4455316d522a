"""GPU check of the attention kernels: correctness of every backend, then timings against peers.

1. correctness: every available backend against the reference in bfloat16 on a mixed batch
   (long decodes, a prefix-cached chunk, a whole prompt, sliding window), write_kv, fused ops;
2. timings with CUDA events, median of many launches over rotated inputs (block tables and
   queries change every launch): decode at batch 64/256 with 1k/4k contexts, reported as achieved
   HBM bandwidth against a device-to-device copy measured in the same run, and 2k-token
   prefills (causal, and ``causal=False`` as encoders run them) against torch's flash SDPA on the
   same (dense) tensors.

Prints one table last. Exit status: 0 when every correctness row passes (speed goals are
reported, never enforced), 1 when one fails, 2 without CUDA. ``--dry-run`` runs the whole script
on CPU with tiny shapes and wall-clock timers, to test the script itself.

    python bench/kernels_gpu.py [--dry-run] [--iters N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from batchinfer import kernels
from batchinfer.kernels import fused

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' paged batches
from paged_batches import make_paged_batch  # noqa: E402

DECODE_GOAL = 0.70  # of the copy bandwidth
PREFILL_GOAL = 1.30  # time / torch flash SDPA time


@dataclass
class Shape:
    """Model and benchmark sizes (Llama-3-8B attention on GPU; tiny ones for --dry-run)."""

    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    decode: tuple[tuple[int, int], ...] = ((64, 1024), (64, 4096), (256, 1024), (256, 4096))  # (batch, ctx)
    prefill: tuple[tuple[int, int], ...] = ((1, 2048), (4, 2048))  # (sequences, tokens each)
    encoder: tuple[tuple[int, int], ...] = ((4, 2048),)  # causal=False prefills (sequences, tokens each)
    copy_bytes: int = 1 << 30
    rotations: int = 4


DRY = Shape(num_heads=4, num_kv_heads=2, head_dim=64, decode=((2, 64), (4, 128)), prefill=((1, 64),),
            encoder=((2, 32),), copy_bytes=1 << 22, rotations=2)


@dataclass
class Row:
    section: str
    case: str
    backend: str
    time_us: float | None = None
    metric: str = ""  # e.g. "3512 GB/s", "max err 0.008"
    peer: str = ""  # what the ratio is against
    ratio: float | None = None
    goal: str = ""
    status: str = ""  # PASS / FAIL / MISS / "" (informational)


class Timer:
    """Median duration of ``fn`` calls in microseconds: CUDA events on GPU, perf_counter on CPU."""

    def __init__(self, device: torch.device, iters: int, warmup: int = 3):
        self.cuda = device.type == "cuda"
        self.iters, self.warmup = iters, warmup

    def __call__(self, fns: list[Callable[[], object]]) -> float:
        for i in range(self.warmup):
            fns[i % len(fns)]()
        times = []
        for i in range(self.iters):
            fn = fns[i % len(fns)]  # rotate inputs: no launch reuses the previous one's data
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                times.append((start, end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        if self.cuda:
            torch.cuda.synchronize()
            return statistics.median(s.elapsed_time(e) for s, e in times) * 1e3
        return statistics.median(times) * 1e6


def correctness(shape: Shape, device: torch.device, backends: list[str]) -> list[Row]:
    """Every backend against the reference on bf16 inputs; write_kv and fused ops against torch."""
    rows = []
    seqs = [(1, 1), (4100, 1), (777, 1), (2048, 512), (130, 130), (33, 5)] if device.type == "cuda" \
        else [(1, 1), (70, 1), (40, 9), (17, 17)]
    batch = make_paged_batch(seqs, shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.block_size,
                             torch.bfloat16, device)
    for window, causal in ((None, True), (256, True), (None, False)):
        kw = dict(sliding_window=window, causal=causal)
        ref = kernels.paged_attention(*batch.args(), **kw, backend="reference").float()
        for name in backends:
            out = kernels.paged_attention(*batch.args(), **kw, backend=name).float()
            err = (out - ref).abs().max().item()
            ok = torch.allclose(out, ref, atol=2e-2, rtol=2e-2)
            case = f"paged_attention window={window}" + ("" if causal else " causal=False")
            rows.append(Row("correct", case, name, metric=f"max err {err:.4f}",
                            goal="atol=rtol=2e-2", status="PASS" if ok else "FAIL"))
    k = torch.randn(64, shape.num_kv_heads, shape.head_dim, device=device, dtype=torch.bfloat16)
    slots = torch.randperm(batch.k_cache.shape[0] * shape.block_size, device=device)[:64]
    slots[::7] = -1
    written = []
    for name in ("reference", *[b for b in backends if b != "reference"]):
        caches = batch.k_cache.clone(), batch.v_cache.clone()
        kernels.write_kv(k, -k, *caches, slots, backend=name)
        written.append(caches)
        same = all(torch.equal(a, b) for a, b in zip(written[0], caches, strict=True))
        rows.append(Row("correct", "write_kv (-1 slots)", name, metric="bit-exact" if same else "differs",
                        goal="== reference", status="PASS" if same else "FAIL"))
    rows += _fused_rows(device)
    return rows


def _fused_rows(device: torch.device) -> list[Row]:
    """fused.* on ``device`` (Triton on CUDA) against the torch path on CPU."""
    x = torch.randn(256, 4096, device=device, dtype=torch.bfloat16)
    w, res = torch.randn(4096, device=device, dtype=torch.bfloat16), torch.randn_like(x)
    q = torch.randn(256, 32, 128, device=device, dtype=torch.bfloat16)
    kk = torch.randn(256, 8, 128, device=device, dtype=torch.bfloat16)
    angles = torch.rand(4096, 64, device=device) * 100
    cos_sin, pos = torch.cat([angles.cos(), angles.sin()], -1), torch.randint(0, 4096, (256,), device=device)
    cases = {
        "rms_norm+residual": (lambda *a: fused.rms_norm(*a)[0], (x, w, 1e-5, res)),
        "silu_and_mul": (fused.silu_and_mul, (x,)),
        "rotary (neox)": (lambda *a: fused.rotary_embedding(*a)[0], (pos, q, kk, cos_sin)),
    }
    rows = []
    for case, (fn, args) in cases.items():
        got = fn(*args).float().cpu()
        want = fn(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in args]).float()
        ok = torch.allclose(got, want, atol=3e-2, rtol=2**-7)
        rows.append(Row("correct", case, "triton" if device.type == "cuda" else "torch",
                        metric=f"max err {(got - want).abs().max().item():.4f}", goal="1 bf16 ulp",
                        status="PASS" if ok else "FAIL"))
    return rows


def copy_bandwidth(shape: Shape, device: torch.device, timer: Timer) -> tuple[Row, float]:
    """The peer of the decode rows: a device-to-device copy, bytes read + written per second."""
    src = torch.empty(shape.copy_bytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    us = timer([lambda: dst.copy_(src)])
    gbps = 2 * shape.copy_bytes / us / 1e3
    return Row("bandwidth", f"copy {shape.copy_bytes >> 20} MiB", "torch", us, f"{gbps:.0f} GB/s"), gbps


def _paged_inputs(shape: Shape, device: torch.device, num_seqs: int, length: int, num_q: int, dtype):
    """Rotated inputs over one shared cache: a different random block placement and q each time."""
    blocks_per_seq = -(-length // shape.block_size)
    num_blocks = 2 * num_seqs * blocks_per_seq  # twice the need, so placements differ between rotations
    cache_shape = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
    k_cache = torch.randn(cache_shape, device=device, dtype=dtype)
    v_cache = torch.randn(cache_shape, device=device, dtype=dtype)
    cu = torch.arange(0, (num_seqs + 1) * num_q, num_q, dtype=torch.int32, device=device)
    lens = torch.full((num_seqs,), length, dtype=torch.int32, device=device)
    sets = []
    for _ in range(shape.rotations):
        tables = torch.randperm(num_blocks, device=device)[:num_seqs * blocks_per_seq].view(num_seqs, -1)
        q = torch.randn(num_seqs * num_q, shape.num_heads, shape.head_dim, device=device, dtype=dtype)
        sets.append((q, k_cache, v_cache, tables.to(torch.int32), cu, lens))
    return sets


def _dense(shape: Shape, device: torch.device, num_seqs: int, num_q: int, length: int):
    """SDPA's inputs for the same problem: q [B, H, Lq, D], k and v [B, KVH, L, D] (bf16)."""
    def randn(heads: int, n: int) -> torch.Tensor:
        return torch.randn(num_seqs, heads, n, shape.head_dim, device=device, dtype=torch.bfloat16)

    return randn(shape.num_heads, num_q), randn(shape.num_kv_heads, length), randn(shape.num_kv_heads, length)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """torch SDPA, flash kernel when it accepts the inputs (GQA via enable_gqa)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    with sdpa_kernel(order if q.is_cuda else [SDPBackend.MATH]):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


def decode_rows(shape: Shape, device: torch.device, backends: list[str], timer: Timer, copy_gbps: float):
    rows = []
    for num_seqs, length in shape.decode:
        sets = _paged_inputs(shape, device, num_seqs, length, 1, torch.bfloat16)
        kv_bytes = 2 * num_seqs * length * shape.num_kv_heads * shape.head_dim * 2  # K and V, bf16
        case = f"decode b={num_seqs} ctx={length}"
        for name in backends:
            us = timer([lambda s=s, name=name: kernels.paged_attention(*s, backend=name) for s in sets])
            gbps = kv_bytes / us / 1e3
            ratio = gbps / copy_gbps
            rows.append(Row("decode", case, name, us, f"{gbps:.0f} GB/s", "copy bandwidth", ratio,
                            f">= {DECODE_GOAL:.0%}", "PASS" if ratio >= DECODE_GOAL else "MISS"))
        dense = _dense(shape, device, num_seqs, 1, length)
        us = timer([lambda dense=dense: _sdpa(*dense, causal=False)])
        rows.append(Row("decode", case, "torch sdpa (dense)", us, f"{kv_bytes / us / 1e3:.0f} GB/s",
                        "copy bandwidth", kv_bytes / us / 1e3 / copy_gbps))
    return rows


def prefill_rows(shape: Shape, device: torch.device, backends: list[str], timer: Timer):
    rows = []
    cases = [(n, length, True) for n, length in shape.prefill] + [(n, length, False) for n, length in
                                                                  shape.encoder]
    for num_seqs, length, causal in cases:
        sets = _paged_inputs(shape, device, num_seqs, length, length, torch.bfloat16)
        flops = (2 if causal else 4) * num_seqs * length * length * shape.num_heads * shape.head_dim
        dense = _dense(shape, device, num_seqs, length, length)
        sdpa_us = timer([lambda dense=dense, causal=causal: _sdpa(*dense, causal=causal)])
        case = f"prefill {num_seqs}x{length}" + ("" if causal else " causal=False")
        rows.append(Row("prefill", case, "torch sdpa (dense)", sdpa_us,
                        f"{flops / sdpa_us / 1e6:.0f} TFLOP/s"))
        for name in backends:
            us = timer([lambda s=s, name=name, causal=causal: kernels.paged_attention(
                *s, backend=name, causal=causal) for s in sets])
            ratio = us / sdpa_us
            rows.append(Row("prefill", case, name, us, f"{flops / us / 1e6:.0f} TFLOP/s", "time / sdpa time",
                            ratio, f"<= {PREFILL_GOAL}x", "PASS" if ratio <= PREFILL_GOAL else "MISS"))
    return rows


def format_table(rows: list[Row]) -> str:
    """Fixed-width table, one row per measurement."""
    header = ["section", "case", "backend", "time (us)", "result", "ratio", "vs", "goal", "status"]
    body = [[r.section, r.case, r.backend, "" if r.time_us is None else f"{r.time_us:.1f}", r.metric,
             "" if r.ratio is None else f"{r.ratio:.2f}", r.peer, r.goal, r.status] for r in rows]
    widths = [max(len(str(line[i])) for line in [header, *body]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*header), fmt.format(*["-" * w for w in widths])]
    return "\n".join([*lines, *(fmt.format(*line) for line in body)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU: test the script itself")
    parser.add_argument("--iters", type=int, default=None, help="timed launches per row (default 100; 3 dry)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print(f"kernels_gpu: CUDA is not available (torch {torch.__version__}); run this on a GPU machine, "
              "or pass --dry-run to exercise the script on CPU", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.dry_run else "cuda")
    shape = DRY if args.dry_run else Shape()
    timer = Timer(device, args.iters or (3 if args.dry_run else 100), warmup=1 if args.dry_run else 5)
    # On CPU only the reference runs (the Triton interpreter is far too slow to time).
    backends = ["reference"] if args.dry_run else \
        [b for b in kernels.available_backends(device, torch.bfloat16, shape.block_size, shape.head_dim)
         if b != "reference"]
    t0 = time.perf_counter()
    print(f"kernels_gpu: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu (dry run)'}, "
          f"torch {torch.__version__}, backends {backends}", flush=True)
    rows = correctness(shape, device, backends)
    copy_row, copy_gbps = copy_bandwidth(shape, device, timer)
    rows.append(copy_row)
    rows += decode_rows(shape, device, backends, timer, copy_gbps)
    rows += prefill_rows(shape, device, backends, timer)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    failed = [r for r in rows if r.status == "FAIL"]
    print(f"\n== kernels: {len(rows)} rows in {time.perf_counter() - t0:.0f}s, "
          f"{len(failed)} correctness failures ==")
    print(format_table(rows), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
