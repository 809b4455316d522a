"""Rotary position embedding tables, computed exactly as transformers computes them.

The table is ``[max_positions, rot_dim]`` float32: the cosines of a position's angles in the
first half, the sines in the second (the layout ``kernels.fused.rotary_embedding`` reads).
"""

from __future__ import annotations

import math
from typing import Any

import torch


def inv_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> torch.Tensor:
    """The ``head_dim / 2`` inverse frequencies, with ``linear`` or ``llama3`` scaling applied."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", "default")
    if scaling is None or rope_type == "default":
        return inv_freq
    factor = float(scaling["factor"])
    if rope_type == "linear":
        return inv_freq / factor  # positions stretched by `factor`
    if rope_type == "llama3":
        return _llama3(inv_freq, factor, scaling)
    raise ValueError(f"rope scaling type {rope_type!r} is not supported (default, linear, llama3)")


def _llama3(inv_freq: torch.Tensor, factor: float, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: slow down low frequencies by ``factor``, keep high ones, blend in between."""
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def cos_sin_cache(
    max_positions: int, head_dim: int, theta: float, scaling: dict[str, Any] | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:  # [max_positions, head_dim] float32
    """``cat(cos(p * inv_freq), sin(p * inv_freq))`` for every position p < ``max_positions``."""
    inv_freq = inv_frequencies(head_dim, theta, scaling).to(device)  # [D / 2]
    positions = torch.arange(max_positions, device=device, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]  # [P, D / 2], float32 like transformers
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)
