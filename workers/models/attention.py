"""Per-step attention inputs shared by every layer of one forward pass."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """What ``kernels.write_kv`` / ``kernels.paged_attention`` need for one step.

    Sequences are concatenated in the step's order; each contributes its last
    ``cu_seqlens_q[i+1] - cu_seqlens_q[i]`` tokens (a prefill chunk or one decode token).
    """

    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token (-1 = skip)
    block_tables: torch.Tensor  # [S, max_blocks] int32
    cu_seqlens_q: torch.Tensor  # [S + 1] int32
    seq_lens: torch.Tensor  # [S] int32: context length including this step's tokens
    max_seqlen_q: int
    max_seqlen_k: int
    backend: str | None = None  # kernels backend; None = best for the device
