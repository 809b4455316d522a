"""``LoRAMapping``: which tokens of one step use which adapter slot, built once per step on the
host (numpy) and shared by every layer's ``add_lora``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

# Rows of one Triton program (a block of one segment). Fixed so the block table can be built
# once per step on the host, whatever the layer; 16 is tl.dot's smallest M.
TRITON_BLOCK_M = 16


@dataclass(frozen=True)
class LoRAMapping:
    """Tokens grouped by adapter slot.

    ``token_slots`` [T] (device, int64; -1: the base model) is the whole truth; the rest is its
    grouping: ``token_indices`` [M] (device, int64) lists the tokens that use a slot, grouped by
    slot (ascending), in step order within a group; segment k is ``token_indices[seg_bounds[k]:
    seg_bounds[k+1]]``, all of slot ``seg_slots[k]`` whose adapter has rank ``seg_ranks[k]``.

    ``block_table`` [NB, 4] (device, int64) cuts every segment into blocks of ``block_m`` rows for
    the Triton kernels: row b is ``(start, end, slot, rank)``, the block's rows being
    ``token_indices[start:min(start + block_m, end)]`` (``end``: its segment's end). Built on the
    host with the rest, so a launch needs no device read; None (a mapping made by hand) makes
    the Triton backend build it per call.

    ``first_row`` (host): when the adapter tokens are one contiguous run of the step's tokens in
    ``token_indices`` order (an engine that orders its step's sequences by slot), the index of
    the run's first token, so segment k is simply rows ``first_row + seg_bounds[k]`` onwards of
    ``x`` and ``y`` (the CPU path then works on views: no gather, no scatter); else None.
    """

    token_slots: torch.Tensor  # [T] int64
    token_indices: torch.Tensor  # [M] int64
    seg_slots: tuple[int, ...]  # host
    seg_bounds: tuple[int, ...]  # host, len(seg_slots) + 1
    seg_ranks: tuple[int, ...]  # host
    block_table: torch.Tensor | None = None  # [NB, 4] int64: start, end, slot, rank
    block_m: int = TRITON_BLOCK_M
    first_row: int | None = None

    @classmethod
    def build(cls, token_slots: np.ndarray, slot_ranks: Sequence[int],
              device: torch.device | str = "cpu") -> LoRAMapping | None:
        """The mapping of a step whose token t uses slot ``token_slots[t]`` (-1: none), slot s
        holding an adapter of rank ``slot_ranks[s]``; None when no token uses an adapter."""
        slots = np.asarray(token_slots, dtype=np.int64).reshape(-1)
        used = np.flatnonzero(slots >= 0)
        if used.size == 0:
            return None
        order = used[np.argsort(slots[used], kind="stable")]
        grouped = slots[order]
        starts = np.flatnonzero(np.r_[True, grouped[1:] != grouped[:-1]])
        seg_slots = tuple(int(s) for s in grouped[starts])
        bounds = (*(int(b) for b in starts), int(order.size))
        seg_ranks = tuple(int(slot_ranks[s]) for s in seg_slots)
        table = block_table_np(bounds, seg_slots, seg_ranks, TRITON_BLOCK_M)
        # One host-to-device copy for the three tensors (views of one buffer).
        buffer = torch.from_numpy(np.concatenate([slots, order, table.reshape(-1)])).to(device)
        num_tokens, num_used = slots.size, order.size
        contiguous = int(order[-1]) - int(order[0]) + 1 == num_used and bool((np.diff(order) == 1).all())
        return cls(token_slots=buffer[:num_tokens], token_indices=buffer[num_tokens:num_tokens + num_used],
                   seg_slots=seg_slots, seg_bounds=bounds, seg_ranks=seg_ranks,
                   block_table=buffer[num_tokens + num_used:].view(-1, 4), block_m=TRITON_BLOCK_M,
                   first_row=int(order[0]) if contiguous else None)


def block_table_np(seg_bounds: Sequence[int], seg_slots: Sequence[int], seg_ranks: Sequence[int],
                   block_m: int) -> np.ndarray:  # [NB, 4] int64
    """Every segment cut into blocks of ``block_m`` rows: ``(start, end, slot, rank)`` per block."""
    bounds = np.asarray(seg_bounds, dtype=np.int64)
    lengths = bounds[1:] - bounds[:-1]  # [K]
    blocks = -(-lengths // block_m)  # [K]
    seg = np.repeat(np.arange(lengths.size), blocks)  # [NB] segment of each block
    first = np.repeat(np.cumsum(blocks) - blocks, blocks)  # [NB] the segment's first block
    start = bounds[seg] + (np.arange(seg.size) - first) * block_m
    return np.stack([start, bounds[seg + 1], np.asarray(seg_slots, dtype=np.int64)[seg],
                     np.asarray(seg_ranks, dtype=np.int64)[seg]], axis=1)
