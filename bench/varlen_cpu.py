"""CPU cost of ``varlen_attention`` (packed, no padding) against torch SDPA over padded sequences.

The shapes of a BERT embedding step (all-MiniLM-L6-v2: 12 heads x 32, 384 hidden, 6 layers) on
``--seqs`` texts of 8-256 tokens. Peers, timed on the same q/k/v already laid out for them (their
pad/unpad copies are not counted, which favours them):

- ``sdpa padded``: one [S, H, Lmax, D] SDPA call with a key-padding mask (HF BertModel's sdpa path);
- ``sdpa sorted x32``: texts sorted by length, padded per batch of 32 (sentence-transformers' order);
- ``layer matmuls``: one layer's dense projections and MLP on the packed tokens, for scale.

Outputs are checked against each other first. Prints one table last (line starting with ``== ``).

    python bench/varlen_cpu.py [--seqs 64] [--threads N] [--iters 5] [--cpu-clock]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from batchinfer import kernels

HEADS, HEAD_DIM, HIDDEN, LAYERS = 12, 32, 384, 6


CLOCK = time.perf_counter  # --cpu-clock: time.process_time (robust on a loaded, shared machine)


def best_ms(fn: Callable[[], object], iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        t0 = CLOCK()
        fn()
        times.append(CLOCK() - t0)
    return min(times) * 1e3


def padded(x: torch.Tensor, cu: list[int], order: list[int], width: int) -> torch.Tensor:
    """Sequences ``order`` of packed ``x`` [T, H, D] as a zero-padded [B, H, width, D] batch."""
    out = x.new_zeros(len(order), x.shape[1], width, x.shape[2])
    for row, i in enumerate(order):
        out[row, :, :cu[i + 1] - cu[i]] = x[cu[i]:cu[i + 1]].transpose(0, 1)
    return out


def sdpa_batches(q, k, v, cu: list[int], batches: list[list[int]]):
    """Per batch of sequence indices: padded q/k/v and the key-padding mask [B, 1, 1, width]."""
    out = []
    for order in batches:
        lens = torch.tensor([cu[i + 1] - cu[i] for i in order])
        width = int(lens.max())
        mask = (torch.arange(width)[None, :] < lens[:, None])[:, None, None, :]
        out.append((*(padded(x, cu, order, width) for x in (q, k, v)), mask))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--cpu-clock", action="store_true",
                        help="time with the process's CPU time, not wall time (use with --threads 1)")
    args = parser.parse_args(argv)
    global CLOCK
    CLOCK = time.process_time if args.cpu_clock else time.perf_counter
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(8, 257, (args.seqs,), generator=gen)
    cu_t = torch.zeros(args.seqs + 1, dtype=torch.int32)
    cu_t[1:] = torch.cumsum(lengths, 0)
    cu, total = cu_t.tolist(), int(cu_t[-1])
    q, k, v = (torch.randn(total, HEADS, HEAD_DIM, generator=gen) for _ in range(3))

    one = sdpa_batches(q, k, v, cu, [list(range(args.seqs))])
    by_len = sorted(range(args.seqs), key=lambda i: cu[i + 1] - cu[i])
    sorted32 = sdpa_batches(q, k, v, cu, [by_len[i:i + 32] for i in range(0, args.seqs, 32)])
    out = kernels.varlen_attention(q, k, v, cu_t, causal=False)
    (pq, pk, pv, mask), = one
    ref = F.scaled_dot_product_attention(pq, pk, pv, attn_mask=mask)
    for i in range(args.seqs):  # the same numbers, or the timings compare different work
        got, want = out[cu[i]:cu[i + 1]].transpose(0, 1), ref[i, :, :cu[i + 1] - cu[i]]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)

    x = torch.randn(total, HIDDEN, generator=gen)
    w = {name: torch.randn(*shape, generator=gen) * 0.02 for name, shape in
         (("qkv", (HIDDEN, 3 * HIDDEN)), ("o", (HIDDEN, HIDDEN)), ("up", (HIDDEN, 4 * HIDDEN)),
          ("down", (4 * HIDDEN, HIDDEN)))}
    rows = [
        ("varlen_attention (cpu, causal=False)", best_ms(lambda: kernels.varlen_attention(
            q, k, v, cu_t, causal=False), args.iters)),
        ("varlen_attention (cpu, causal=True)", best_ms(lambda: kernels.varlen_attention(
            q, k, v, cu_t, causal=True), args.iters)),
        ("sdpa padded (one batch, masked)", best_ms(lambda: [F.scaled_dot_product_attention(
            a, b, c, attn_mask=m) for a, b, c, m in one], args.iters)),
        ("sdpa sorted x32 (masked)", best_ms(lambda: [F.scaled_dot_product_attention(
            a, b, c, attn_mask=m) for a, b, c, m in sorted32], args.iters)),
        ("layer matmuls (qkv, o, mlp)", best_ms(lambda: (x @ w["qkv"], x @ w["o"],
                                                          F.gelu(x @ w["up"]) @ w["down"]), args.iters)),
    ]
    base = rows[0][1]
    print(f"\n== varlen_cpu: {args.seqs} texts, {total} tokens, {HEADS}x{HEAD_DIM} heads, "
          f"{torch.get_num_threads()} threads, {'CPU' if args.cpu_clock else 'wall'} time; per layer "
          f"(x{LAYERS} for the model) ==")
    print(f"{'case':<40} {'ms/layer':>9} {'vs varlen':>9}")
    for name, ms in rows:
        print(f"{name:<40} {ms:>9.1f} {ms / base:>8.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
