"""Rotary position embedding tables, computed exactly as transformers computes them.

The table is ``[max_positions, rot_dim]`` float32: the cosines of a position's angles in the
first half, the sines in the second (the layout ``kernels.fused.rotary_embedding`` reads), both
already multiplied by the scaling type's attention factor (YaRN's mscale, LongRoPE's factor), as
transformers multiplies its cos / sin. ``rot_dim`` is the rotated part of a head
(``head_dim * partial_rotary_factor``); the kernel leaves the rest of the head as it is.

``scaling`` is the dictionary ``ModelConfig`` builds (``rope_type`` plus that type's fields, with
``original_max_position_embeddings`` and ``factor`` filled in). Two types depend on the length in
transformers, which recomputes its frequencies per forward call; one static table cannot, so:

- ``dynamic``: the frequencies at ``seq_len = max(table length, original context)``. A table no
  longer than the model's ``max_position_embeddings`` (the engine never runs past it) is plain
  RoPE, which is what transformers uses inside that context.
- ``longrope``: one regime per table, vLLM's rule: the long factors when the table is longer than
  ``original_max_position_embeddings``, else the short ones. transformers instead picks per call
  by its longest position, so a sequence that stays within the original context gets the short
  factors there; a per-sequence switch would rotate a prefix-cached block differently depending
  on who computed it, and a sequence crossing the boundary would keep keys of the other regime.
"""

from __future__ import annotations

import math
from typing import Any

import torch

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


def inv_frequencies(
    rot_dim: int, theta: float, scaling: dict[str, Any] | None = None, seq_len: int | None = None,
) -> torch.Tensor:  # [rot_dim / 2] float32
    """The inverse frequencies of ``scaling`` (transformers' ``ROPE_INIT_FUNCTIONS`` at ``seq_len``).

    ``seq_len`` matters only to ``dynamic`` (frequencies for that length, never below the original
    context) and ``longrope`` (long factors iff ``seq_len > original_max_position_embeddings``).
    """
    exponents = torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim
    rope_type = (scaling or {}).get("rope_type", "default")
    if scaling is None or rope_type == "default":
        return 1.0 / (theta**exponents)
    if rope_type == "linear":
        return 1.0 / (theta**exponents) / float(scaling["factor"])  # positions stretched by `factor`
    if rope_type == "llama3":
        return _llama3(1.0 / (theta**exponents), float(scaling["factor"]), scaling)
    if rope_type == "dynamic":
        return _dynamic(exponents, rot_dim, theta, scaling, seq_len)
    if rope_type == "yarn":
        return _yarn(exponents, rot_dim, theta, scaling)
    if rope_type == "longrope":
        original = int(scaling["original_max_position_embeddings"])
        factors = scaling["long_factor"] if seq_len and seq_len > original else scaling["short_factor"]
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta**exponents)
    raise ValueError(f"rope scaling type {rope_type!r} is not supported ({', '.join(ROPE_TYPES)})")


def attention_factor(scaling: dict[str, Any] | None) -> float:
    """What cos and sin are multiplied by (1 except for ``yarn`` and ``longrope``), as transformers does."""
    rope_type = (scaling or {}).get("rope_type", "default")
    if scaling is None or rope_type not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    if rope_type == "longrope":
        original = int(scaling["original_max_position_embeddings"])
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
    return _yarn_mscale(factor)


def cos_sin_cache(
    max_positions: int, rot_dim: int, theta: float, scaling: dict[str, Any] | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:  # [max_positions, rot_dim] float32
    """``cat(cos(p * inv_freq), sin(p * inv_freq)) * attention_factor`` for each p < ``max_positions``."""
    if rot_dim <= 0 or rot_dim % 2:
        raise ValueError(f"the rotary dimension must be even and positive, got {rot_dim}")
    inv_freq = inv_frequencies(rot_dim, theta, scaling, seq_len=max_positions).to(device)  # [R / 2]
    positions = torch.arange(max_positions, device=device, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]  # [P, R / 2], float32 like transformers
    table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    scale = attention_factor(scaling)
    return table if scale == 1.0 else table * scale


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


def _dynamic(exponents: torch.Tensor, rot_dim: int, theta: float, scaling: dict[str, Any],
             seq_len: int | None) -> torch.Tensor:
    """Dynamic NTK: a larger base for a longer sequence; the plain base within the original context."""
    factor = float(scaling["factor"])
    original = int(scaling["original_max_position_embeddings"])
    length = max(seq_len or original, original)
    base = theta * ((factor * length / original) - (factor - 1)) ** (rot_dim / (rot_dim - 2))
    return 1.0 / (base**exponents)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(exponents: torch.Tensor, rot_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN: interpolate low frequencies by ``factor``, extrapolate high ones, ramp in between."""
    factor = float(scaling["factor"])
    original = int(scaling["original_max_position_embeddings"])
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times
        return (rot_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rot_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(rot_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1 where frequencies are kept as they are
    pos_freqs = theta**exponents
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
