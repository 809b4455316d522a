"""Decode attention, two builds side by side in one process: the CPU extension from an earlier
revision's sources against this checkout's, on the same caches, timed alternately (best of 5, four
rounds each), outputs compared bit for bit. What an engine-level before / after cannot show for a
kernel change inside this host's ±5-10 % run-to-run spread.

    git worktree add /tmp/before <rev>     # or any folder holding an earlier kernels/cpu_ext
    OMP_NUM_THREADS=1 python -P bench/decode_ab.py /tmp/before/kernels/cpu_ext --heads 8,4

The earlier kernel compiles alone (its ``paged_decode.cpp``) into its own op namespace
(``-DBATCHINFER_OPS_NS=batchinfer_decode_ab``), so both load at once. Cases: float32 and bfloat16
caches, ``B`` sequences of ragged lengths drawn from [L/4, L] over shuffled blocks, one query each,
one thread (thread CPU time). Prints ms per call of both, K/V GB/s, the speed ratio (earlier ÷ this)
and whether the outputs are identical; the last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from batchinfer.kernels.cpu_ext import decode

# bench/ for engine_cpu's timer: put here, since `python -P` leaves the script's folder off sys.path
sys.path[:0] = [str(Path(__file__).resolve().parent)]
import engine_cpu  # noqa: E402

CASES = ((1, 512), (16, 512), (64, 512), (256, 128), (256, 512), (64, 2048))
QUICK = ((1, 512), (16, 512))


def earlier_build(folder: Path) -> decode.Build:
    """The kernel from ``folder``'s ``paged_decode.cpp`` alone (it needs none of the library's other
    sources: a quarter of the build time)."""
    if not (folder / "paged_decode.cpp").is_file():
        raise SystemExit(f"{folder}: no paged_decode.cpp (pass an earlier checkout's kernels/cpu_ext)")
    return decode.Build(source=folder / "paged_decode.cpp",
                        cflags=(*decode.CFLAGS, "-DBATCHINFER_OPS_NS=batchinfer_decode_ab"), extra_sources=())


def run_case(ops: dict[str, Callable[..., None]], dtype: torch.dtype, B: int, L: int,
             shape: tuple[int, int, int, int], gen: torch.Generator, rounds: int) -> dict:
    """One case: both builds on the same caches (``shape`` = heads, KV heads, head_dim, block size)."""
    H, KVH, D, bs = shape
    nb = -(-L // bs)
    cache = (B * nb + 8, bs, KVH, D)
    lens = torch.randint(max(1, L // 4), L + 1, (B,), generator=gen).int()
    k = torch.randn(cache, generator=gen).to(dtype)
    v = torch.randn(cache, generator=gen).to(dtype)
    tables = torch.randperm(cache[0], generator=gen)[:B * nb].view(B, nb).int()
    q = torch.randn(B, H, D, generator=gen).to(dtype)
    cu = torch.arange(B + 1, dtype=torch.int32)
    outs = {name: torch.empty_like(q) for name in ops}
    calls = {name: partial(op, q, k, v, tables, cu, lens, D**-0.5, 0, 0.0, -1, outs[name])
             for name, op in ops.items()}
    for call in calls.values():
        call()
    identical = torch.equal(outs["before"], outs["this"])
    times: dict[str, list[float]] = {name: [] for name in ops}
    for _ in range(rounds):
        for name, call in calls.items():
            times[name].append(engine_cpu._timed(call))
    kv = 2 * int(lens.sum()) * KVH * D * dtype.itemsize
    before, this = min(times["before"]), min(times["this"])
    return {"dtype": str(dtype).removeprefix("torch."), "batch": B, "context": L,
            "before_ms": round(before * 1e3, 4), "this_ms": round(this * 1e3, 4),
            "before_gb_per_s": round(kv / before / 1e9, 2), "this_gb_per_s": round(kv / this / 1e9, 2),
            "speedup": round(before / this, 3), "identical": identical}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before", type=Path, help="a folder holding the earlier kernels/cpu_ext sources")
    ap.add_argument("--heads", default="8,4", help="query heads,KV heads (default 8,4: the engine bench's "
                                                   "model; 9,3 is SmolLM2's)")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=4, help="alternating timings of each build a case")
    ap.add_argument("--quick", action="store_true", help="two small cases only")
    args = ap.parse_args()
    torch.set_num_threads(1)
    engine_cpu.CPU_CLOCK = True  # its _timed on this thread's CPU time, as its --cpu-clock
    H, KVH = (int(x) for x in args.heads.split(","))
    D, bs = args.head_dim, args.block_size
    builds = {"before": earlier_build(args.before), "this": decode.Build()}
    ops = {name: build.op() for name, build in builds.items()}
    for name, op in ops.items():
        if op is None:
            raise SystemExit(f"the {name} build failed: {builds[name].reason}")
    print(f"decode attention, {H} heads over {KVH}, head_dim {D}, blocks of {bs}, 1 thread; ms per call "
          "(thread CPU, best of 5), earlier build vs this checkout's")
    gen, results = torch.Generator().manual_seed(0), []
    for dtype in (torch.float32, torch.bfloat16):
        for B, L in QUICK if args.quick else CASES:
            row = run_case(ops, dtype, B, L, (H, KVH, D, bs), gen, args.rounds)
            results.append(row)
            differ = "" if row["identical"] else "  OUTPUTS DIFFER"
            print(f"  {row['dtype']:8s} {B:4d} x {L:5d}  before {row['before_ms']:8.3f} "
                  f"({row['before_gb_per_s']:5.1f} GB/s)  this {row['this_ms']:8.3f} "
                  f"({row['this_gb_per_s']:5.1f} GB/s)  {row['speedup']:5.3f}x{differ}", flush=True)
    print(json.dumps({"decode_ab": results}))


if __name__ == "__main__":
    main()
