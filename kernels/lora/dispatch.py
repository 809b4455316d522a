"""``add_lora``'s input checks and backend table (selected by ``registry.Family``).

Checks read shapes, dtypes, devices and the mapping's host tuples only (never a tensor value: no
device sync). ``backend=None``: ``cpu`` on CPU tensors, ``triton`` on CUDA when Triton imports,
else ``cpu`` (plain torch, it runs on any device); the Triton interpreter is never chosen
automatically. An unknown name is a ``ValueError``, an unavailable one a ``RuntimeError``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from batchinfer.kernels.lora.mapping import LoRAMapping
from batchinfer.kernels.registry import REFERENCE, TRITON, Backend, Family, anywhere


def check_inputs(
    y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: Sequence[torch.Tensor],
    mapping: LoRAMapping,
) -> None:
    """Raise ``ValueError`` naming the first argument that breaks the contract."""
    if x.dim() != 2:
        raise ValueError(f"add_lora: x must be [num_tokens, in_features], got shape {tuple(x.shape)}")
    num_tokens, in_features = x.shape
    if isinstance(lora_b, torch.Tensor) or len(lora_b) == 0:
        raise ValueError("add_lora: lora_b must be a non-empty list or tuple of S tensors [L, out_i, R]")
    num_slices = len(lora_b)
    if lora_a.dim() != 3 or lora_a.shape[2] != in_features or lora_a.shape[1] % num_slices:
        raise ValueError(f"add_lora: lora_a must be [num_slots, {num_slices} * max_rank, {in_features}] "
                         f"({num_slices} = len(lora_b)), got shape {tuple(lora_a.shape)}")
    num_slots, rank = lora_a.shape[0], lora_a.shape[1] // num_slices
    for i, b in enumerate(lora_b):
        if b.dim() != 3 or b.shape[0] != num_slots or b.shape[2] != rank:
            raise ValueError(f"add_lora: lora_b[{i}] must be [{num_slots}, out_features, {rank}] to match "
                             f"lora_a {tuple(lora_a.shape)}, got shape {tuple(b.shape)}")
    out_features = sum(b.shape[1] for b in lora_b)
    if y.dim() != 2 or y.shape != (num_tokens, out_features):
        raise ValueError(f"add_lora: y must be [{num_tokens}, {out_features}] (num_tokens, the sum of "
                         f"lora_b's out sizes), got shape {tuple(y.shape)}")
    if mapping.token_slots.shape != (num_tokens,):
        raise ValueError(f"add_lora: mapping.token_slots must be [{num_tokens}] (x's num_tokens), "
                         f"got shape {tuple(mapping.token_slots.shape)}")
    if mapping.seg_slots and not 0 <= min(mapping.seg_slots) <= max(mapping.seg_slots) < num_slots:
        raise ValueError(f"add_lora: mapping uses slots {list(mapping.seg_slots)} but lora_a has "
                         f"{num_slots} slots")
    if mapping.seg_ranks and max(mapping.seg_ranks) > rank:
        raise ValueError(f"add_lora: mapping.seg_ranks {list(mapping.seg_ranks)} exceed the stacked "
                         f"max_rank {rank} of lora_a")
    if not x.dtype.is_floating_point:
        raise ValueError(f"add_lora: x must be floating point, got {x.dtype}")
    tensors = [("y", y), ("lora_a", lora_a), *((f"lora_b[{i}]", b) for i, b in enumerate(lora_b))]
    for name, t in tensors:
        if t.dtype != x.dtype:
            raise ValueError(f"add_lora: {name} is {t.dtype} but x is {x.dtype}")
    tensors += [("mapping.token_slots", mapping.token_slots),
                ("mapping.token_indices", mapping.token_indices)]
    for name, t in tensors:
        if t.device != x.device:
            raise ValueError(f"add_lora: {name} is on {t.device} but x is on {x.device}")


# This ``cpu`` is plain torch on any device (unlike attention's): it serves CUDA when Triton does not import.
LORA = Family("add_lora", (TRITON, REFERENCE, Backend("cpu", anywhere)),
              {"cuda": ("triton", "cpu", "reference")}, fallback=("cpu", "triton", "reference"))
LORA_BACKENDS = LORA.names  # ("triton", "reference", "cpu")

unavailable_reason = LORA.unavailable_reason
select_backend = LORA.select_backend
available_backends = LORA.available_backends
