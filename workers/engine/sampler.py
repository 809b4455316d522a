"""The sampler: logits of one step -> one token per completion, with per-request seeds.

The order of operations is vLLM's:

1. logprobs are read off the raw model distribution (``log_softmax`` of the unprocessed logits);
2. ``min_tokens``: while a completion is shorter, its EOS ids (unless ``ignore_eos``) and its
   ``stop_token_ids`` are masked;
3. repetition penalty (Hugging Face / vLLM definition, over prompt + output tokens);
4. frequency / presence penalties (OpenAI definition, over output tokens);
5. greedy rows take the argmax here, so greedy equals ``transformers``' greedy token for token;
6. temperature -> top-k -> top-p -> min-p -> sample.

Every stage works on the whole batch (or the sub-batch that needs it) at once, penalties touch
only the (row, token) pairs they concern, and top-k / top-p look at a ``topk`` candidate set
before falling back to a full sort. Sampling inverts each row's cumulative distribution (float64)
at one uniform draw; a seeded completion draws it from its own generator, so its tokens do not
depend on what else shares the batch, on its row position, or on the vocabulary size.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

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
    # generator for unseeded rows). It draws one number per step, so a CPU generator is right even
    # when logits are on a GPU.
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
    (the default): the sampler draws a single number from it per step.
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
        token_ids = logits.argmax(dim=-1)  # [N]; final for greedy rows
        random = [i for i, r in enumerate(rows) if not r.params.greedy]
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
        # Each filter runs only on the rows that use it.
        sel = [j for j, r in enumerate(rows) if r.params.top_k > 0 or r.params.top_p < 1.0]
        if sel:
            top_k = torch.tensor([min(rows[j].params.top_k, vocab) or vocab for j in sel], device=device)
            top_p = torch.tensor([rows[j].params.top_p for j in sel], device=device)
            logits[sel] = apply_top_k_top_p(logits[sel], top_k, top_p)
        sel = [j for j, r in enumerate(rows) if r.params.min_p > 0.0]
        if sel:
            min_p = torch.tensor([rows[j].params.min_p for j in sel], device=device)
            logits[sel] = apply_min_p(logits[sel], min_p)
        return sample_from_logits(logits, [r.generator for r in rows], self.generator)


def _per_row(rows: list[SamplingRow], sel: list[int], name: str, default: float, device) -> torch.Tensor:
    """[N] float32: parameter ``name`` for the rows in ``sel``, ``default`` elsewhere."""
    values = [default] * len(rows)
    for i in sel:
        values[i] = getattr(rows[i].params, name)
    return torch.tensor(values, dtype=torch.float32, device=device)


def sample_from_logits(logits: torch.Tensor, generators: Sequence[torch.Generator | None],
                       default: torch.Generator | None = None) -> torch.Tensor:
    """One token per row with probability ``softmax(logits)``; logits [M, V] -> ids [M].

    Inverse transform sampling: a uniform ``u`` per row (from the row's generator, else from
    ``default``, a CPU generator, else the global CPU RNG) is located in the row's cumulative
    weights, summed in float64 so that even tokens of probability 1e-9 in a 150k vocabulary keep
    their share. A token of weight 0 (masked) is never returned: the first cumulative weight above
    ``u * total`` always has a weight of its own.
    """
    weights = (logits - logits.max(dim=-1, keepdim=True).values).exp()  # [M, V]; masked -> 0
    cdf = weights.cumsum(dim=-1, dtype=torch.float64)  # [M, V]
    u = torch.rand(len(generators), dtype=torch.float64, generator=default)  # [M]
    for j, g in enumerate(generators):
        if g is not None:
            u[j] = torch.rand(1, dtype=torch.float64, generator=g, device=g.device).item()
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
    result depends only on the values, never on how a sort orders equal logits.

    Only the ``max(k, candidates)`` largest logits are sorted (``topk``); a row whose nucleus
    reaches past them is redone with a full sort.
    """
    vocab = logits.shape[1]
    use_k, use_p = top_k < vocab, top_p < 1.0
    if not (use_k.any() or use_p.any()):
        return logits
    width = max(int(top_k[use_k].max()) if use_k.any() else 0, candidates if use_p.any() else 0)
    ranked = logits.topk(min(width, vocab), dim=-1).values  # [M, W], descending
    kth = ranked.gather(1, (top_k.clamp(max=ranked.shape[1]) - 1).long().unsqueeze(1))  # [M, 1]
    kth = torch.where(use_k.unsqueeze(1), kth, float("-inf"))
    logits = logits.masked_fill(logits < kth, float("-inf"))
    if not use_p.any():
        return logits
    ranked = ranked.masked_fill(ranked < kth, float("-inf"))
    threshold, found = _nucleus_threshold(logits, ranked, top_p)
    redo = (use_p & ~found).nonzero().squeeze(1)
    if ranked.shape[1] < vocab and len(redo):
        full = logits[redo].sort(dim=-1, descending=True).values
        threshold[redo] = _nucleus_threshold(logits[redo], full, top_p[redo])[0]
    threshold = torch.where(use_p.unsqueeze(1), threshold, float("-inf"))
    return logits.masked_fill(logits < threshold, float("-inf"))


def _nucleus_threshold(
    logits: torch.Tensor, ranked: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The logit at which the cumulative probability of ``ranked`` (the largest logits of each row,
    descending) reaches top_p: [M, 1], and [M] bool, False where ``ranked`` holds too little mass
    (then the threshold is -inf)."""
    probs = (ranked - logits.logsumexp(dim=-1, keepdim=True)).exp()  # [M, W], shares of the row
    reached = probs.cumsum(dim=-1) >= top_p.unsqueeze(1)  # [M, W]
    found = reached.any(dim=-1)
    first = reached.int().argmax(dim=-1, keepdim=True)  # the first position that reaches top_p
    threshold = torch.where(found.unsqueeze(1), ranked.gather(1, first), float("-inf"))
    return threshold, found


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask (-inf) tokens whose probability is below min_p times the row's largest probability.

    logits [M, V]; min_p [M] in [0, 1] (0 = off). p_i < min_p * p_max is tested in logit space,
    logit_i < logit_max + log(min_p), which needs no softmax.
    """
    threshold = logits.max(dim=-1, keepdim=True).values + min_p.log().unsqueeze(1)  # [M, 1]
    return logits.masked_fill(logits < threshold, float("-inf"))
