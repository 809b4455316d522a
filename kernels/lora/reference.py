"""The specification of ``add_lora``: every token's own A and B gathered, float32 accumulation."""

from __future__ import annotations

import torch


def add_lora(
    y: torch.Tensor,  # [T, sum(out_i)]
    x: torch.Tensor,  # [T, in]
    lora_a: torch.Tensor,  # [L, S * R, in]
    lora_b: tuple[torch.Tensor, ...] | list[torch.Tensor],  # S x [L, out_i, R]
    token_slots: torch.Tensor,  # [T] int64, -1: no adapter
) -> torch.Tensor:
    rows = (token_slots >= 0).nonzero().squeeze(1)  # [M]
    if rows.numel() == 0:
        return y
    slots = token_slots[rows]  # [M]
    R = lora_a.shape[1] // len(lora_b)
    h = torch.einsum("mi,mri->mr", x[rows].float(), lora_a[slots].float())  # [M, S * R]
    offset = 0
    for i, b in enumerate(lora_b):
        out = b.shape[1]
        delta = torch.einsum("mr,mor->mo", h[:, i * R:(i + 1) * R], b[slots].float())  # [M, out_i]
        y[rows, offset:offset + out] += delta.to(y.dtype)
        offset += out
    return y
