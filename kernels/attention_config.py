"""Launch shapes of the Triton attention kernel: a pure policy of tensor shapes (never values,
so choosing one costs no host sync), kept apart from the kernels so it is tested without Triton."""

from __future__ import annotations

from dataclasses import dataclass


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclass(frozen=True)
class AttentionConfig:
    """Launch shape of one call (pure function of shapes, see ``choose_config``)."""

    block_m: int  # rows per program: BLOCK_Q query tokens x GROUP heads, padded to a power of 2
    block_q: int  # query tokens per program
    tile_n: int  # keys per inner-loop step
    num_splits: int  # split-K factor (1 = no split), a power of 2
    num_warps: int = 4
    num_stages: int = 2


def choose_config(
    num_q_tokens: int, num_seqs: int, num_heads: int, num_kv_heads: int, max_context: int,
    num_sms: int,
) -> AttentionConfig:
    """Pick tile sizes and the split-K factor from shapes only (never from tensor values).

    ``max_context`` is the block table's capacity (``max_blocks * block_size``), an upper bound
    on any sequence's length; ``num_sms`` the GPU's multiprocessor count (0 = unknown/CPU).
    """
    group = num_heads // num_kv_heads
    group_pow2 = _next_power_of_2(group)
    if num_q_tokens == num_seqs:  # decode-only batch: one query per sequence
        block_m = max(16, group_pow2)  # tl.dot needs >= 16 rows
        tile_n = 64
        splits = 1
        programs = num_seqs * num_kv_heads
        max_tiles = -(-max_context // tile_n)
        # Too few programs to keep every SM streaming keys: split long contexts, while keeping
        # at least 4 tiles of work per split so the merge stays cheap.
        while num_sms and programs * splits < 2 * num_sms and max_tiles >= 8 * splits and splits < 32:
            splits *= 2
        return AttentionConfig(block_m, 1, tile_n, splits, num_warps=4, num_stages=3)
    block_m = max(64 if num_q_tokens < 1024 else 128, group_pow2)
    num_warps = 8 if block_m >= 128 else 4
    return AttentionConfig(block_m, block_m // group, 64, 1, num_warps=num_warps, num_stages=2)
