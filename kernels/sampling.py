"""The sampler's tensor ops: per-row top-k / top-p / min-p thresholds and inverse-CDF draws.

Pure functions of tensors (no request state: ``workers/engine/sampler.py`` holds that). A seeded
row's uniform is a stateless counter hash (:func:`counter_uniforms`, splitmix64 in int64 ops);
top-k and top-p become one threshold logit per row, read off the row sorted once (a wide
vocabulary first tries its largest candidates). On the CPU the ops torch runs slowly on one
thread at these shapes (sort, argmax, exp, a broadcast compare: 5-30x numpy's time) run in numpy
on the same memory.
"""

from __future__ import annotations

import numpy as np
import torch

MASK64 = 2**64 - 1


def splitmix64(x: int) -> int:
    """splitmix64's finaliser of a 64-bit state (Python integers)."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def signed64(x: int) -> int:
    """A 64-bit constant as the int64 torch stores it."""
    return x - 2**64 if x >= 2**63 else x


_GOLDEN = signed64(0x9E3779B97F4A7C15)
_MIX1 = signed64(0xBF58476D1CE4E5B9)
_MIX2 = signed64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic: it would copy the sign bit)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def counter_uniforms(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """One uniform in [0, 1) per (key, counter), float64, from a stateless hash; keys, counters [M] int64.

    splitmix64 of ``key + (counter + 1) * golden``, the same integer arithmetic as
    :func:`splitmix64` in wrapping int64 ops, for all rows in one go: a row's draw depends only on
    its own key and counter, never on the other rows or on any generator's state. The top 53 bits
    make the float64.
    """
    x = keys + (counters + 1) * _GOLDEN  # int64 arithmetic wraps: mod 2**64, as splitmix64's
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    x = x ^ _shr(x, 31)
    return _shr(x, 11).to(torch.float64) * 2.0**-53


# e**-80 is a normal float32 (its smallest is about e**-87): the weight floor of unmasked tokens.
_EXP_FLOOR = -80.0
_FINITE_MIN = torch.finfo(torch.float32).min  # logits >= it: every token but a masked (-inf) one


def sample_from_logits(logits: torch.Tensor, uniforms: torch.Tensor,
                       threshold: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row with probability ``softmax(logits)``; logits [M, V], uniforms [M] float64
    in [0, 1) -> ids [M].

    ``threshold`` [M, 1] (optional): tokens whose logit is below their row's are masked first (as
    ``apply_top_k_top_p`` / ``apply_min_p`` would mask them; -inf keeps all).

    Inverse transform sampling: row j's uniform is located in the row's cumulative weights, summed
    in float64 so that even tokens of probability 1e-9 in a 150k vocabulary keep their share. A
    token of weight 0 (masked) is never returned: the first cumulative weight above
    ``u * total`` always has a weight of its own. The uniforms come from the caller: a seeded
    row's from :func:`counter_uniforms`, the others' from a generator.
    """
    # exp() of -inf or of values it underflows on is slow on CPUs (denormal paths): clamp the
    # exponent where e**x is still a normal float, then zero the masked tokens by multiplication.
    shifted = (logits - logits.amax(dim=-1, keepdim=True)).clamp(min=_EXP_FLOOR)  # [M, V]
    if threshold is None:
        floor = torch.full_like(logits[:, :1], _FINITE_MIN)  # [M, 1]
    else:
        floor = threshold.clamp(min=_FINITE_MIN)
    weights = _exp(shifted) * _at_or_above(logits, floor)  # [M, V]; masked (-inf, below threshold) -> 0
    cdf = weights.cumsum(dim=-1, dtype=torch.float64)  # [M, V]
    total = cdf[:, -1:]  # [M, 1]
    # u < 1, but u * total may round up to total: stay strictly below it.
    target = torch.minimum(uniforms.to(logits.device).unsqueeze(1) * total,
                           total.nextafter(torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, candidates: int = 256
) -> torch.Tensor:
    """Mask (-inf) tokens outside each row's top k and outside its nucleus.

    logits [M, V]; top_k [M] int in 1..V (V = off); top_p [M] float in (0, 1] (1 = off).
    Top-k keeps tokens whose logit is >= the k-th largest. Top-p then keeps, of what remains, the
    tokens whose logit is >= that of the token at which the cumulative probability (most probable
    first) reaches top_p: the smallest such set. Ties at either boundary all survive, so the
    result depends only on the values, never on how a sort orders equal logits. The thresholds
    come from :func:`top_k_top_p_threshold`.
    """
    threshold = top_k_top_p_threshold(logits, top_k, top_p, candidates)
    return logits.masked_fill(logits < threshold, float("-inf"))


def top_k_top_p_threshold(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, candidates: int = 256
) -> torch.Tensor:
    """Per row, the smallest logit that top-k and top-p keep ([M, 1]; -inf: both off), as
    :func:`apply_top_k_top_p` defines them.

    Both come off the row sorted once (:func:`_sorted_threshold`). In a vocabulary wider than
    ``16 * max(k, candidates)`` the largest candidates are tried first, and only the rows whose
    nucleus reaches past them are sorted whole.
    """
    vocab = logits.shape[1]
    use_k, use_p = top_k < vocab, top_p < 1.0
    any_k, any_p = bool(use_k.any()), bool(use_p.any())
    off = torch.full((logits.shape[0], 1), float("-inf"), device=logits.device)
    if not (any_k or any_p):
        return off
    width = max(int(top_k[use_k].max()) if any_k else 0, candidates if any_p else 0)
    if vocab <= 16 * width:
        return _sorted_threshold(logits, top_k, top_p)
    ranked = _largest(logits, min(width, vocab))  # [M, W] descending
    kth = ranked.gather(1, (top_k.clamp(max=ranked.shape[1]) - 1).long().unsqueeze(1))  # [M, 1]
    kth = torch.where(use_k.unsqueeze(1), kth, float("-inf"))
    if not any_p:
        return kth
    # top-p sees the top-k only: its mass and candidates are those at or above kth
    ranked = ranked.masked_fill(ranked < kth, float("-inf")) if any_k else ranked
    threshold, found = _nucleus_threshold(_logsumexp(logits, kth if any_k else None), ranked, top_p)
    redo = (use_p & ~found).nonzero().squeeze(1)
    if len(redo):
        threshold[redo] = _sorted_threshold(logits[redo], top_k[redo], top_p[redo])
    # the nucleus of the top-k lies within it: its threshold is >= kth wherever top-p is on
    return torch.where(use_p.unsqueeze(1), threshold, kth)


def _numpy_ok(x: torch.Tensor) -> bool:
    """Whether the CPU-only numpy paths below may take ``x``: a float32 tensor in host memory."""
    return x.device.type == "cpu" and x.dtype == torch.float32


def _largest(logits: torch.Tensor, width: int) -> torch.Tensor:
    """Each row's ``width`` largest values, largest first ([M, W]). CPU: numpy's partition and a
    sort of the W (4x faster than torch's single-thread ``topk`` of [64, 49152])."""
    if not _numpy_ok(logits):
        return logits.topk(width, dim=-1).values
    vocab = logits.shape[1]
    top = np.partition(logits.detach().numpy(), vocab - width, axis=1)[:, vocab - width:]
    top.sort(axis=1)
    return torch.from_numpy(top[:, ::-1].copy())


def _logsumexp(logits: torch.Tensor, floor: torch.Tensor | None = None) -> torch.Tensor:
    """[M, 1]: log of each row's sum of e**logit over the tokens at or above ``floor`` ([M, 1];
    None: all). CPU: numpy's exp (torch's single-thread ``logsumexp`` of [64, 49152] takes ~5 ms,
    this ~2; a masked copy of the logits would take ~10 ms more)."""
    top = logits.amax(dim=-1, keepdim=True)  # [M, 1]
    if not _numpy_ok(logits):
        kept = logits if floor is None else logits.masked_fill(logits < floor, float("-inf"))
        return kept.logsumexp(dim=-1, keepdim=True)
    weights = np.exp((logits - top).detach().numpy())  # [M, V]
    if floor is not None:
        weights *= np.greater_equal(logits.detach().numpy(), floor.detach().numpy())
    return torch.from_numpy(weights.sum(axis=1, keepdims=True)).log() + top


def _sort_descending(logits: torch.Tensor) -> torch.Tensor:
    """Each row's values, largest first ([M, V] float32). CPU: numpy's sort (torch's single-thread
    sort of [256, 320] takes ~3 ms, numpy's ~0.1 ms); the values alone, so any order of ties."""
    if not _numpy_ok(logits):
        return logits.sort(dim=-1, descending=True).values
    ascending = np.sort(logits.detach().numpy(), axis=1)
    return torch.from_numpy(ascending[:, ::-1].copy())  # a positive-stride copy, as torch needs


def _sorted_threshold(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-k then top-p thresholds [M, 1] of float32 logits [M, V] from one sort of each row.

    top_k [M] (V or more: off), top_p [M] (1: off). Top-k's threshold is the k-th largest value.
    Top-p's is the largest logit t whose mass at or above t, within the top k (ties at the k-th
    included), reaches top_p of the top k's mass: the first position of the descending cumulative
    weights that reaches ``top_p * mass``. Weights are ``e**(x - max)`` (clamped where e**x stays a
    normal float, so a masked -inf token weighs e**-80: nothing a float64 sum of ones can see),
    summed in float64 per row in sorted order, so a row's thresholds depend on that row alone.
    """
    vocab = logits.shape[1]
    desc = _sort_descending(logits)  # [M, V]
    k = top_k.clamp(1, vocab).long().unsqueeze(1)  # [M, 1]
    kth = desc.gather(1, k - 1)  # [M, 1]
    # tokens at or above the k-th (its ties too): a prefix of the sorted row
    in_k = torch.searchsorted(-desc, -kth, right=True)  # [M, 1], in 1..V
    weights = _exp((desc - desc[:, :1]).clamp(min=_EXP_FLOOR))  # [M, V], 1 at the top
    cdf = weights.cumsum(dim=-1, dtype=torch.float64)  # [M, V]
    mass = cdf.gather(1, in_k - 1)  # [M, 1]: the top k's
    # p * mass <= mass (p <= 1), so the position found lies within the top k
    reach = torch.searchsorted(cdf, top_p.to(torch.float64).unsqueeze(1) * mass)  # [M, 1]
    nucleus = desc.gather(1, reach.clamp(max=vocab - 1))
    use_k, use_p = (top_k < vocab).unsqueeze(1), (top_p < 1.0).unsqueeze(1)
    threshold = torch.where(use_p, nucleus, torch.where(use_k, kth, float("-inf")))
    return threshold.to(logits.dtype)


def _exp(x: torch.Tensor) -> torch.Tensor:
    """``x.exp()``; on the CPU numpy's (2x faster at [256, 320] on one thread)."""
    if not _numpy_ok(x):
        return x.exp()
    return torch.from_numpy(np.exp(x.detach().numpy()))


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's first largest value's index ([M] int64); on the CPU numpy's (torch's single-thread
    argmax of [256, 320] takes ~115 us, numpy's ~8; of [256, 151936] 47 ms against 8)."""
    if not _numpy_ok(x):
        return x.argmax(dim=-1)
    return torch.from_numpy(np.argmax(x.detach().numpy(), axis=1).astype(np.int64))


def _at_or_above(x: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    """``x >= floor`` (floor [M, 1] broadcast over [M, V]) as x's dtype: 1 where kept, 0 where not.
    CPU: numpy's compare (torch's broadcast compare of [256, 320] takes ~55 us, numpy's ~16)."""
    if not _numpy_ok(x):
        return (x >= floor).to(x.dtype)
    return torch.from_numpy(np.greater_equal(x.detach().numpy(), floor.detach().numpy()).astype(np.float32))


def _nucleus_threshold(
    lse: torch.Tensor, ranked: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The logit at which the cumulative probability of ``ranked`` (the largest logits of each row,
    descending; ``lse`` [M, 1] the log of the row's whole mass) reaches top_p: [M, 1], and [M] bool,
    False where ``ranked`` holds too little mass (then the threshold is -inf)."""
    probs = (ranked - lse).exp()  # [M, W], shares of the row
    short = probs.cumsum(dim=-1) < top_p.unsqueeze(1)  # [M, W]: a prefix of each row (cumsum grows)
    first = short.sum(dim=-1, keepdim=True)  # [M, 1]: the first position that reaches top_p
    found = first.squeeze(1) < ranked.shape[1]
    threshold = torch.where(found.unsqueeze(1), ranked.gather(1, first.clamp(max=ranked.shape[1] - 1)),
                            float("-inf"))
    return threshold, found


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask (-inf) tokens whose probability is below min_p times the row's largest probability.

    logits [M, V]; min_p [M] in [0, 1] (0 = off). p_i < min_p * p_max is tested in logit space,
    logit_i < logit_max + log(min_p), which needs no softmax.
    """
    return logits.masked_fill(logits < min_p_threshold(logits, min_p), float("-inf"))


def min_p_threshold(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """[M, 1]: the smallest logit min-p keeps, ``logit_max + log(min_p)`` (-inf where min_p is 0)."""
    return logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)
