"""The sampler: logits of one step -> one token per completion, with per-request seeds.

The order of operations is vLLM's:

1. logprobs are read off the raw model distribution (``log_softmax`` of the unprocessed logits);
2. ``min_tokens``: while a completion is shorter, its EOS ids (unless ``ignore_eos``) and its
   ``stop_token_ids`` are masked;
3. repetition penalty (Hugging Face / vLLM definition, over prompt + output tokens);
4. frequency / presence penalties (OpenAI definition, over output tokens);
5. greedy rows take the argmax here, so greedy equals ``transformers``' greedy token for token;
6. temperature -> top-k -> top-p -> min-p -> sample.

Every stage works on the whole batch (or the sub-batch that needs it) at once, and penalties
touch only the (row, token) pairs they concern. Top-k and top-p become one threshold per row,
read off the row's logits sorted once (a wide vocabulary first tries its largest candidates).
On the CPU the ops torch runs slowly on one thread at these shapes (sort, argmax, exp, a
broadcast compare: 5-30x numpy's time) run in numpy on the same memory.
Sampling inverts each row's cumulative distribution (float64) at one uniform draw; a seeded
completion's draw is a stateless hash of (its seed, completion index, output position), made for
all seeded rows at once, so its tokens do not depend on what else shares the batch, on its row
position, or on the vocabulary size.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from batchinfer.workers.engine.outputs import Logprob, SampleLogprobs
from batchinfer.workers.sampling_params import SamplingParams

_MASK64 = 2**64 - 1


@dataclass
class SamplingRow:
    """One completion being sampled this step."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # tokens generated so far by this completion
    # make_generator(seed, completion index) when params.seed is set, else None (the sampler's
    # generator for unseeded rows). Its seed keys the row's counter-based draws (counter_uniforms,
    # counted by len(output_token_ids)); its state is never consumed. A CPU one, whatever the device.
    generator: torch.Generator | None = None


@dataclass
class SamplerOutput:
    """One sampled token per row and, where asked for, its logprobs."""

    token_ids: list[int]
    # Per row: {sampled token and the top-`logprobs` tokens: Logprob} of the raw distribution
    # (logprob and rank; the engine adds the decoded tokens).
    logprobs: list[SampleLogprobs | None]


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def make_generator(seed: int, completion_index: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The generator of completion ``completion_index`` (0..n-1) of a request with ``seed``.

    The two are mixed (not added, as vLLM does) so that completion 1 of seed 0 and completion 0
    of seed 1 do not coincide, while every completion stays reproducible. Keep it on the CPU
    (the default). The sampler reads only its seed, the key of :func:`counter_uniforms`: a
    completion's draw at output position i is a hash of (key, i), made for every seeded row of a
    step in one op, so no generator state advances and no per-row draw is made.
    """
    g = torch.Generator(device=device)
    g.manual_seed(_splitmix64(_splitmix64(seed & _MASK64) ^ completion_index))
    return g


def _flat_indices(
    row_ids: Sequence[int], token_lists: Sequence[Sequence[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) pairs for ``index_put_`` from one token list per row."""
    pairs = zip(row_ids, token_lists, strict=True)
    rows = list(itertools.chain.from_iterable(itertools.repeat(r, len(t)) for r, t in pairs))
    toks = list(itertools.chain.from_iterable(token_lists))
    return (torch.tensor(rows, dtype=torch.long, device=device),
            torch.tensor(toks, dtype=torch.long, device=device))


def _column(values: Sequence[float], device: torch.device) -> torch.Tensor:
    """Per-row parameters as a [M, 1] float32 column that broadcasts over the vocabulary."""
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)


class Sampler:
    """Turns a step's logits ``[N, V]`` into one token per row (see the module docstring)."""

    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int],
                 generator: torch.Generator | None = None):
        """``generator`` (a CPU one) draws for rows without their own; None = torch's global RNG."""
        self.vocab_size = vocab_size
        self.eos_token_ids = [t for t in eos_token_ids if 0 <= t < vocab_size]
        self.generator = generator

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(rows) or logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits must be [{len(rows)}, >={self.vocab_size}], got {list(logits.shape)}")
        # Columns past the tokenizer's vocabulary are padding of the embedding matrix: never sampled.
        logits = logits[:, : self.vocab_size].float()
        raw_logprobs = self._raw_logprobs(logits, rows)

        logits = self.apply_penalties(logits, rows)
        random = [i for i, r in enumerate(rows) if not r.params.greedy]
        if len(random) == len(rows):  # no greedy row: no argmax, no sub-batch copy of [N, V]
            token_ids = self._sample(logits, rows)
        else:
            token_ids = _argmax(logits)  # [N]; final for greedy rows
            if random:
                token_ids[random] = self._sample(logits[random], [rows[i] for i in random])
        ids = token_ids.tolist()
        return SamplerOutput(ids, self._gather_logprobs(raw_logprobs, ids, rows))

    def apply_penalties(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Steps 2-4: min_tokens masking, repetition, frequency and presence penalties.

        logits [N, V] -> [N, V], a new tensor unless no row needs any of them; greedy rows take
        its argmax.
        """
        if not any(self._needs_processing(r) for r in rows):
            return logits  # the common greedy / plain case: no copy of [N, V]
        logits = logits.clone()  # the stages work in place
        self._mask_stop_tokens(logits, rows)
        self._repetition_penalty(logits, rows)
        self._frequency_presence_penalties(logits, rows)
        return logits

    @staticmethod
    def _needs_processing(r: SamplingRow) -> bool:
        p = r.params
        return (len(r.output_token_ids) < p.min_tokens or p.repetition_penalty != 1.0
                or bool(p.frequency_penalty or p.presence_penalty))

    # -- logprobs -------------------------------------------------------------------------------

    @staticmethod
    def _raw_logprobs(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], torch.Tensor] | None:
        """The rows that want logprobs and their log_softmax [M, V], taken before any processing."""
        want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if not want:
            return None
        return want, torch.log_softmax(logits[want], dim=-1)

    @staticmethod
    def _gather_logprobs(
        raw: tuple[list[int], torch.Tensor] | None, ids: list[int], rows: list[SamplingRow]
    ) -> list[SampleLogprobs | None]:
        """Per row asking for them: the sampled token's and the top-k tokens' ``Logprob`` (with rank).

        The top-k hold ranks 1..k in ``topk``'s order; a sampled token outside them gets vLLM's
        rank (1 + tokens strictly more likely), at least k + 1: where it ties with a top-k token,
        that token keeps its rank, so ranks 1..k always name exactly the top k.
        """
        out: list[SampleLogprobs | None] = [None] * len(rows)
        if raw is None:
            return out
        want, logprobs = raw  # [M, V]
        tops = [rows[i].params.logprobs or 0 for i in want]  # every one is set: that is what `want` holds
        vals_t, ids_t = logprobs.topk(max(tops), dim=-1)  # [M, k]
        picked = torch.tensor([[ids[i]] for i in want], device=logprobs.device)
        sampled_t = logprobs.gather(1, picked)  # [M, 1]
        above_t = (logprobs > sampled_t).sum(dim=-1)  # [M]: tokens more likely than the sampled one
        top_vals: list[list[float]] = vals_t.tolist()
        top_ids: list[list[int]] = ids_t.tolist()
        sampled: list[float] = sampled_t.squeeze(1).tolist()
        above: list[int] = above_t.tolist()
        for j, i in enumerate(want):
            n = tops[j]
            top = top_ids[j][:n]
            rank = top.index(ids[i]) + 1 if ids[i] in top else max(above[j] + 1, n + 1)
            d = {ids[i]: Logprob(sampled[j], rank)}  # the sampled token first, as vLLM lists it
            for r, (t, v) in enumerate(zip(top, top_vals[j][:n], strict=True), start=1):
                if t not in d:
                    d[t] = Logprob(v, r)
            out[i] = d
        return out

    # -- logits processors (in place on [N, V]) -------------------------------------------------

    def _mask_stop_tokens(self, logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        """min_tokens: a completion cannot end (EOS / stop_token_ids) before it has that many tokens."""
        row_ids, banned = [], []
        for i, r in enumerate(rows):
            p = r.params
            if len(r.output_token_ids) < p.min_tokens:
                # `or ()` only narrows the type: __post_init__ has made stop_token_ids a list
                ids = [t for t in p.stop_token_ids or () if t < self.vocab_size]
                if not p.ignore_eos:
                    ids += self.eos_token_ids
                if ids:
                    row_ids.append(i)
                    banned.append(ids)
        if row_ids:
            logits.index_put_(_flat_indices(row_ids, banned, logits.device),
                              torch.tensor(float("-inf"), device=logits.device))

    @staticmethod
    def _repetition_penalty(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        """Tokens seen in prompt or output: positive logits divided by the penalty, others multiplied."""
        sel = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
        if not sel:
            return
        tokens = [list(rows[i].prompt_token_ids) + list(rows[i].output_token_ids) for i in sel]
        r, t = _flat_indices(sel, tokens, logits.device)
        vocab = logits.shape[1]
        pairs = torch.unique(r * vocab + t)  # [P] distinct (row, token): a token is penalised once
        r, t = pairs // vocab, pairs % vocab
        penalty = _per_row(rows, sel, "repetition_penalty", 1.0, logits.device)[r]  # [P]
        seen = logits[r, t]
        logits[r, t] = torch.where(seen > 0, seen / penalty, seen * penalty)

    @staticmethod
    def _frequency_presence_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        """logit -= frequency_penalty * count + presence_penalty * (count > 0), counts over output tokens."""
        sel = [i for i, r in enumerate(rows)
               if (r.params.frequency_penalty or r.params.presence_penalty) and len(r.output_token_ids)]
        if not sel:
            return
        vocab = logits.shape[1]
        r, t = _flat_indices(sel, [rows[i].output_token_ids for i in sel], logits.device)
        pairs, counts = torch.unique(r * vocab + t, return_counts=True)  # distinct (row, token)
        r, t = pairs // vocab, pairs % vocab
        freq = _per_row(rows, sel, "frequency_penalty", 0.0, logits.device)[r]
        pres = _per_row(rows, sel, "presence_penalty", 0.0, logits.device)[r]
        logits[r, t] -= freq * counts + pres

    # -- random sampling ------------------------------------------------------------------------

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p, then one draw per row; logits [M, V] -> ids [M]."""
        device, vocab = logits.device, logits.shape[1]
        logits = logits / _column([r.params.temperature for r in rows], device)
        # The filters become one threshold per row ([M, 1], -inf: keep all) that the draw applies
        # as it weighs the tokens: no masked copy of [M, V]. Each runs only on the rows that use it.
        threshold = None
        sel = [j for j, r in enumerate(rows) if r.params.top_k > 0 or r.params.top_p < 1.0]
        if sel:
            top_k = torch.tensor([min(rows[j].params.top_k, vocab) or vocab for j in sel], device=device)
            top_p = torch.tensor([rows[j].params.top_p for j in sel], device=device)
            if len(sel) == len(rows):
                threshold = top_k_top_p_threshold(logits, top_k, top_p)
            else:
                threshold = torch.full((len(rows), 1), float("-inf"), device=device)
                threshold[sel] = top_k_top_p_threshold(logits[sel], top_k, top_p)
        sel = [j for j, r in enumerate(rows) if r.params.min_p > 0.0]
        if sel:
            # min-p after top-k / top-p: those never mask the largest logit, its reference
            min_p = torch.tensor([r.params.min_p for r in rows], device=device)  # 0: log -> -inf, off
            floor = min_p_threshold(logits, min_p)  # [M, 1]
            threshold = floor if threshold is None else torch.maximum(threshold, floor)
        # A seeded row's draw is counted by its output position: the same token whatever the batch.
        return sample_from_logits(logits, [r.generator for r in rows], self.generator,
                                  [len(r.output_token_ids) for r in rows], threshold)


def _per_row(rows: list[SamplingRow], sel: list[int], name: str, default: float, device) -> torch.Tensor:
    """[N] float32: parameter ``name`` for the rows in ``sel``, ``default`` elsewhere."""
    values = [default] * len(rows)
    for i in sel:
        values[i] = getattr(rows[i].params, name)
    return torch.tensor(values, dtype=torch.float32, device=device)


def _signed64(x: int) -> int:
    """A 64-bit constant as the int64 torch stores it."""
    return x - 2**64 if x >= 2**63 else x


_GOLDEN = _signed64(0x9E3779B97F4A7C15)
_MIX1 = _signed64(0xBF58476D1CE4E5B9)
_MIX2 = _signed64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic: it would copy the sign bit)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def counter_uniforms(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """One uniform in [0, 1) per (key, counter), float64, from a stateless hash; keys, counters [M] int64.

    splitmix64 of ``key + (counter + 1) * golden``, the same integer arithmetic as
    :func:`_splitmix64` in wrapping int64 ops, for all rows in one go: a row's draw depends only on
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


def sample_from_logits(logits: torch.Tensor, generators: Sequence[torch.Generator | None],
                       default: torch.Generator | None = None,
                       counters: Sequence[int] | None = None,
                       threshold: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row with probability ``softmax(logits)``; logits [M, V] -> ids [M].

    ``threshold`` [M, 1] (optional): tokens whose logit is below their row's are masked first (as
    ``apply_top_k_top_p`` / ``apply_min_p`` would mask them; -inf keeps all).

    Inverse transform sampling: a uniform ``u`` per row is located in the row's cumulative
    weights, summed in float64 so that even tokens of probability 1e-9 in a 150k vocabulary keep
    their share. A token of weight 0 (masked) is never returned: the first cumulative weight above
    ``u * total`` always has a weight of its own.

    A row with a generator (a seeded completion, :func:`make_generator`) takes ``u`` from
    :func:`counter_uniforms` keyed by the generator's seed and counted by ``counters[j]`` (the
    completion's output position; 0 when ``counters`` is None): every seeded row in one op, the
    generator's state never touched. The other rows draw from ``default`` (a CPU generator),
    else from the global CPU RNG (one ``torch.rand`` of M, as many draws whatever the seeds).
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
    u = torch.rand(len(generators), dtype=torch.float64, generator=default)  # [M]
    seeded = [j for j, g in enumerate(generators) if g is not None]
    if seeded:
        keys = torch.tensor([_signed64(g.initial_seed()) for g in generators if g is not None],
                            dtype=torch.int64)
        steps = torch.tensor([counters[j] for j in seeded] if counters is not None else [0] * len(seeded),
                             dtype=torch.int64)
        u[seeded] = counter_uniforms(keys, steps)
    total = cdf[:, -1:]  # [M, 1]
    # u < 1, but u * total may round up to total: stay strictly below it.
    target = torch.minimum(u.to(logits.device).unsqueeze(1) * total, total.nextafter(torch.zeros_like(total)))
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


def _argmax(x: torch.Tensor) -> torch.Tensor:
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
