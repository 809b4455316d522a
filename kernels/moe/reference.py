"""The specification of ``fused_moe``: top-k routing and a plain per-expert loop, in torch.

Routing is Hugging Face's (Mixtral, Qwen2/3-MoE): softmax of the router logits in float32, the
``top_k`` largest probabilities, optionally renormalised to sum to 1 (``norm_topk_prob``). Each
expert computes ``w2 @ (silu(gate) * up)`` with ``[gate | up] = w13 @ x`` in the weights' dtype;
the weighted sum over a token's experts accumulates in float32 and is cast to the input dtype.
"""

from __future__ import annotations

import torch


def topk_routing(
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, top_k] float32 weights, [T, top_k] int64 expert ids)
    """The experts each token goes to and their weights (shared by every backend)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_experts(
    hidden: torch.Tensor,  # [T, C]
    w13: torch.Tensor,  # [E, 2I, C]: gate rows then up rows
    w2: torch.Tensor,  # [E, C, I]
    topk_weights: torch.Tensor,  # [T, K] float32
    topk_ids: torch.Tensor,  # [T, K] int
) -> torch.Tensor:  # [T, C]
    """``sum_k weight[t, k] * expert_{id[t, k]}(hidden[t])``, one expert at a time."""
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for e in range(w13.shape[0]):
        tokens, slots = torch.where(topk_ids == e)
        if tokens.numel() == 0:
            continue
        gate, up = torch.nn.functional.linear(hidden[tokens], w13[e]).chunk(2, dim=-1)
        y = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w2[e])
        out.index_add_(0, tokens, y.float() * topk_weights[tokens, slots, None])
    return out.to(hidden.dtype)


def fused_moe(
    hidden: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
    top_k: int, renormalize: bool = True,
) -> torch.Tensor:  # [T, C]
    """Route then run the experts (see the module docstring)."""
    weights, ids = topk_routing(router_logits, top_k, renormalize)
    return fused_experts(hidden, w13, w2, weights, ids)
