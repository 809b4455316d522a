"""``LoRAMapping``: which tokens of one step use which adapter slot, built once per step on the
host (numpy) and shared by every layer's ``add_lora``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class LoRAMapping:
    """Tokens grouped by adapter slot.

    ``token_slots`` [T] (device, int64; -1: the base model) is the whole truth; the rest is its
    grouping: ``token_indices`` [M] (device, int64) lists the tokens that use a slot, grouped by
    slot (ascending), in step order within a group; segment k is ``token_indices[seg_bounds[k]:
    seg_bounds[k+1]]``, all of slot ``seg_slots[k]`` whose adapter has rank ``seg_ranks[k]``.
    """

    token_slots: torch.Tensor  # [T] int64
    token_indices: torch.Tensor  # [M] int64
    seg_slots: tuple[int, ...]  # host
    seg_bounds: tuple[int, ...]  # host, len(seg_slots) + 1
    seg_ranks: tuple[int, ...]  # host

    @classmethod
    def build(cls, token_slots: np.ndarray, slot_ranks: Sequence[int],
              device: torch.device | str = "cpu") -> LoRAMapping | None:
        """The mapping of a step whose token t uses slot ``token_slots[t]`` (-1: none), slot s
        holding an adapter of rank ``slot_ranks[s]``; None when no token uses an adapter."""
        slots = np.asarray(token_slots, dtype=np.int64)
        used = np.flatnonzero(slots >= 0)
        if used.size == 0:
            return None
        order = used[np.argsort(slots[used], kind="stable")]
        grouped = slots[order]
        starts = np.flatnonzero(np.r_[True, grouped[1:] != grouped[:-1]])
        seg_slots = tuple(int(s) for s in grouped[starts])
        bounds = (*(int(b) for b in starts), int(order.size))
        return cls(token_slots=torch.from_numpy(slots).to(device),
                   token_indices=torch.from_numpy(order).to(device), seg_slots=seg_slots,
                   seg_bounds=bounds, seg_ranks=tuple(int(slot_ranks[s]) for s in seg_slots))
