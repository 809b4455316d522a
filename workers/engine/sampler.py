"""The sampler: logits of one step -> one token per completion, with per-request seeds.

The order of operations is vLLM's:

1. logprobs are read off the raw model distribution (``log_softmax`` of the unprocessed logits:
   no bias, mask or penalty below changes them);
2. ``logit_bias`` is added (OpenAI's definition: before every other stage);
3. ``allowed_token_ids``: every other token is masked;
4. ``bad_words``: the last token of each bad word's token sequence whose other tokens end the
   completion's output is masked (vLLM's rule; a one-token word always);
5. ``min_tokens``: while a completion is shorter, its EOS ids (unless ``ignore_eos``) and its
   ``stop_token_ids`` are masked; a row that 3-5 leave no token takes its step-2 logits with
   only 3 applied (see ``Sampler._revive``);
6. repetition penalty (Hugging Face / vLLM definition, over prompt + output tokens);
7. frequency / presence penalties (OpenAI definition, over output tokens);
8. greedy rows take the argmax here, so greedy equals ``transformers``' greedy token for token;
9. temperature -> top-k -> top-p -> min-p -> sample.

Every stage works on the whole batch (or the sub-batch that needs it) at once; biases, masks and
penalties touch only the rows and (row, token) pairs they concern, and the logits are copied only
when some row of the step needs one of stages 2-7. The rows' parameters live in a
:class:`SamplingBatch` (vLLM v1's persistent InputBatch / SamplingMetadata): arrays in row order,
updated only when rows join, leave or move, so a decode step reads its index sets and tensors
instead of rebuilding them from every row's params. The tensor ops are
:mod:`batchinfer.kernels.sampling`. A seeded completion's draw is a stateless hash of (its seed,
completion index, output position), made for all seeded rows at once, so its tokens do not
depend on what else shares the batch, on its row position, or on the vocabulary size.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from batchinfer.kernels.sampling import (
    MASK64,
    argmax,
    counter_uniforms,
    min_p_threshold,
    sample_from_logits,
    signed64,
    splitmix64,
    top_k_top_p_threshold,
)
from batchinfer.workers.engine.outputs import Logprob, SampleLogprobs
from batchinfer.workers.sampling_params import SamplingParams


@dataclass(eq=False)  # identity equality: SamplingBatch.update tells rows apart by identity
class SamplingRow:
    """One completion being sampled this step.

    Its ``params`` must not change while it is sampled (the batch reads them once, when it joins).
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # tokens generated so far by this completion
    # make_generator(seed, completion index) when params.seed is set, else None (the sampler's
    # generator for unseeded rows). Its seed keys the row's counter-based draws (counter_uniforms,
    # counted by len(output_token_ids)); its state is never consumed. A CPU one, whatever the device.
    generator: torch.Generator | None = None
    # params.bad_words as token sequences (Request.bad_words_token_ids: each word tokenised
    # as given and with a leading space); empty when the params have none.
    bad_words_token_ids: Sequence[Sequence[int]] = ()


@dataclass
class SamplerOutput:
    """One sampled token per row and, where asked for, its logprobs."""

    token_ids: list[int]
    # Per row: {sampled token and the top-`logprobs` tokens: Logprob} of the raw distribution
    # (logprob and rank; the engine adds the decoded tokens).
    logprobs: list[SampleLogprobs | None]


def make_generator(seed: int, completion_index: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The generator of completion ``completion_index`` (0..n-1) of a request with ``seed``.

    The two are mixed (not added, as vLLM does) so that completion 1 of seed 0 and completion 0
    of seed 1 do not coincide, while every completion stays reproducible. Keep it on the CPU
    (the default). The sampler reads only its seed, the key of :func:`counter_uniforms`: a
    completion's draw at output position i is a hash of (key, i), made for every seeded row of a
    step in one op, so no generator state advances and no per-row draw is made.
    """
    g = torch.Generator(device=device)
    g.manual_seed(splitmix64(splitmix64(seed & MASK64) ^ completion_index))
    return g


# Columns of SamplingBatch.floats (float64: the params' own values, compared as the params are) and
# of SamplingBatch.ints.
_TEMPERATURE, _TOP_P, _MIN_P, _REPETITION, _FREQUENCY, _PRESENCE = range(6)
_TOP_K, _MIN_TOKENS, _LOGPROBS, _SEED_KEY, _SEEDED, _GREEDY = range(6)


def _float32(values: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(values.astype(np.float32))


@dataclass
class _RowTokens:
    """A row's token-id parameters, read once when it joins (ids past the vocabulary dropped)."""

    banned: list[int]  # what min_tokens masks (stop_token_ids, EOS)
    bias_ids: list[int]  # logit_bias, as two parallel lists
    bias_values: list[float]
    allowed: list[int]  # allowed_token_ids; empty: every token
    bad_single: list[int]  # the one-token bad words: masked at every step
    bad_prefixed: list[tuple[list[int], int]]  # (the tokens before it, the token masked after them)


class SamplingBatch:
    """The sampled rows' parameters as arrays in row order, and what each step reads off them.

    :meth:`update` brings it to a step's rows: the same rows in the same order (a decode step)
    change nothing; otherwise the rows that stay are gathered into their new places, only joining
    rows' params are read, and the index sets and tensors are derived again from the arrays.
    """

    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int]):
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.rows: list[SamplingRow] = []
        self.floats = np.zeros((0, 6))  # [N, 6]: the _TEMPERATURE.. columns
        self.ints = np.zeros((0, 6), dtype=np.int64)  # [N, 6]: the _TOP_K.. columns
        self.tokens: list[_RowTokens] = []  # per row: min_tokens' ids, logit_bias, allowed and bad tokens
        self._derive()

    def update(self, rows: list[SamplingRow]) -> None:
        """Make the batch hold ``rows``, in their order."""
        if rows == self.rows:  # identity, row by row (eq=False): the usual decode step
            return
        where = {id(r): i for i, r in enumerate(self.rows)}
        joining = [r for r in rows if id(r) not in where]
        fresh = itertools.count(len(self.rows))  # joining rows' places in the arrays appended below
        index = np.array([where[id(r)] if id(r) in where else next(fresh) for r in rows], dtype=np.intp)
        floats, ints = self._encode(joining)
        self.floats = np.concatenate([self.floats, floats])[index]
        self.ints = np.concatenate([self.ints, ints])[index]
        tokens = self.tokens + [self._row_tokens(r) for r in joining]
        self.tokens = [tokens[i] for i in index.tolist()]
        self.rows = list(rows)
        self._derive()

    def _encode(self, rows: list[SamplingRow]) -> tuple[np.ndarray, np.ndarray]:
        """Joining rows' params: floats [J, 6], ints [J, 6]."""
        floats = np.array([(p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.frequency_penalty,
                            p.presence_penalty) for p in (r.params for r in rows)], dtype=np.float64)
        ints = np.array([(r.params.top_k, r.params.min_tokens,
                          -1 if r.params.logprobs is None else r.params.logprobs,
                          0 if r.generator is None else signed64(r.generator.initial_seed()),
                          r.generator is not None, r.params.greedy) for r in rows], dtype=np.int64)
        return floats.reshape(-1, 6), ints.reshape(-1, 6)

    def _row_tokens(self, row: SamplingRow) -> _RowTokens:
        p, vocab = row.params, self.vocab_size
        # `or ()` only narrows the type: __post_init__ has made stop_token_ids a list
        banned = [t for t in p.stop_token_ids or () if t < vocab]
        bias = [(t, v) for t, v in (p.logit_bias or {}).items() if t < vocab and v != 0.0]
        bad = [list(w) for w in row.bad_words_token_ids if w and all(t < vocab for t in w)]
        return _RowTokens(banned if p.ignore_eos else banned + self.eos_token_ids,
                          [t for t, _ in bias], [v for _, v in bias],
                          [t for t in p.allowed_token_ids or () if t < vocab],
                          sorted({w[0] for w in bad if len(w) == 1}),
                          [(w[:-1], w[-1]) for w in bad if len(w) > 1])

    def _derive(self) -> None:
        """The index sets and tensors the stages read, from the arrays."""
        f, k, vocab = self.floats, self.ints, self.vocab_size
        self.min_tokens_rows: list[int] = np.flatnonzero(k[:, _MIN_TOKENS] > 0).tolist()
        self.min_tokens: list[int] = k[:, _MIN_TOKENS].tolist()
        self.repetition_rows: list[int] = np.flatnonzero(f[:, _REPETITION] != 1.0).tolist()
        self.frequency_rows: list[int] = np.flatnonzero((f[:, _FREQUENCY] != 0.0)
                                                        | (f[:, _PRESENCE] != 0.0)).tolist()
        self.penalties = _float32(f[:, [_REPETITION, _FREQUENCY, _PRESENCE]])  # [N, 3]
        self.logprob_rows: list[int] = np.flatnonzero(k[:, _LOGPROBS] >= 0).tolist()
        self.logprob_counts: list[int] = k[self.logprob_rows, _LOGPROBS].tolist()
        random = np.flatnonzero(k[:, _GREEDY] == 0)  # [M]: the rows drawn at random
        self.random_rows = torch.from_numpy(random)
        self.all_random = len(random) == len(self.rows)
        # The random sub-batch: its rows' temperature column, filters and seeds.
        rf, rk = f[random], k[random]
        self.temperature = _float32(rf[:, _TEMPERATURE]).unsqueeze(1)  # [M, 1]
        filtered = np.flatnonzero((rk[:, _TOP_K] > 0) | (rf[:, _TOP_P] < 1.0))
        self.filtered = torch.from_numpy(filtered) if len(filtered) < len(random) else None  # None: all
        top_k = np.minimum(rk[filtered, _TOP_K], vocab)
        self.top_k = torch.from_numpy(np.where(top_k == 0, vocab, top_k))  # 0: off, as V
        self.top_p = _float32(rf[filtered, _TOP_P])
        self.any_filtered = len(filtered) > 0
        self.min_p = _float32(rf[:, _MIN_P]) if (rf[:, _MIN_P] > 0.0).any() else None  # 0: log -> -inf, off
        seeded = np.flatnonzero(rk[:, _SEEDED])  # places in the sub-batch
        self.seeded = torch.from_numpy(seeded)
        self.seeded_rows: list[int] = random[seeded].tolist()  # their rows in the batch
        self.seed_keys = torch.from_numpy(rk[seeded, _SEED_KEY])
        # The token-id stages' rows and their (row, token) pairs; empty for most batches.
        rows = self.tokens
        self.bias_rows: list[int] = [i for i, t in enumerate(rows) if t.bias_ids]
        self.bias_pair_rows, self.bias_pair_tokens = _flat_indices(self.bias_rows,
                                                                   [rows[i].bias_ids for i in self.bias_rows])
        self.bias_values = torch.tensor([v for i in self.bias_rows for v in rows[i].bias_values],
                                        dtype=torch.float32)
        self.allowed_rows: list[int] = [i for i, t in enumerate(rows) if t.allowed]
        self.allowed_pair_rows, self.allowed_pair_tokens = _flat_indices(
            self.allowed_rows, [rows[i].allowed for i in self.allowed_rows])
        self.bad_words_rows: list[int] = [i for i, t in enumerate(rows) if t.bad_single or t.bad_prefixed]

    def output_lengths(self, rows: list[int]) -> list[int]:
        """How many tokens each of ``rows`` (batch indices) has generated so far."""
        return [len(self.rows[i].output_token_ids) for i in rows]


class Sampler:
    """Turns a step's logits ``[N, V]`` into one token per row (see the module docstring)."""

    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int],
                 generator: torch.Generator | None = None):
        """``generator`` (a CPU one) draws for rows without their own; None = torch's global RNG."""
        self.vocab_size = vocab_size
        self.eos_token_ids = [t for t in eos_token_ids if 0 <= t < vocab_size]
        self.generator = generator
        self.batch = SamplingBatch(vocab_size, self.eos_token_ids)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(rows) or logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits must be [{len(rows)}, >={self.vocab_size}], got {list(logits.shape)}")
        # Columns past the tokenizer's vocabulary are padding of the embedding matrix: never sampled.
        logits = logits[:, : self.vocab_size].float()
        b = self.batch
        b.update(rows if isinstance(rows, list) else list(rows))
        want = b.logprob_rows
        raw_logprobs = torch.log_softmax(logits[want], dim=-1) if want else None  # [M, V], unprocessed

        logits = self.apply_penalties(logits, b.rows)
        if b.all_random:  # no greedy row: no argmax, no sub-batch copy of [N, V]
            token_ids = self._sample(logits)
        else:
            token_ids = argmax(logits)  # [N]; final for greedy rows
            if len(b.random_rows):
                token_ids[b.random_rows] = self._sample(logits[b.random_rows])
        ids = token_ids.tolist()
        return SamplerOutput(ids, self._gather_logprobs(raw_logprobs, ids))

    def apply_penalties(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Steps 2-7, every logits processor: logit_bias, allowed_token_ids, bad_words and min_tokens
        masking, repetition, frequency and presence penalties.

        logits [N, V] -> [N, V], a new tensor unless no row needs any of them; greedy rows take
        its argmax.
        """
        b = self.batch
        b.update(rows)
        short = [i for i, n in zip(b.min_tokens_rows, b.output_lengths(b.min_tokens_rows), strict=True)
                 if n < b.min_tokens[i]]
        bad_rows, bad_tokens = self._bad_word_tokens()
        if not (short or bad_rows or b.bias_rows or b.allowed_rows or b.repetition_rows or b.frequency_rows):
            return logits  # the common greedy / plain case: no copy of [N, V]
        given, logits = logits, logits.clone()  # the stages work in place
        self._logit_bias(logits)
        self._allowed_tokens(logits)
        if bad_rows:
            logits.index_put_(_flat_indices(bad_rows, bad_tokens, logits.device),
                              torch.tensor(float("-inf"), device=logits.device))
        self._mask_stop_tokens(logits, short)
        if short or bad_rows or b.allowed_rows:
            self._revive(logits, given, sorted({*short, *bad_rows, *b.allowed_rows}))
        self._repetition_penalty(logits)
        self._frequency_presence_penalties(logits)
        return logits

    # -- logprobs -------------------------------------------------------------------------------

    def _gather_logprobs(self, logprobs: torch.Tensor | None, ids: list[int]) -> list[SampleLogprobs | None]:
        """Per row asking for them: the sampled token's and the top-k tokens' ``Logprob`` (with rank).

        ``logprobs`` [M, V]: the raw distribution of ``batch.logprob_rows``. The top-k hold ranks
        1..k in ``topk``'s order; a sampled token outside them gets vLLM's rank (1 + tokens strictly
        more likely), at least k + 1: where it ties with a top-k token, that token keeps its rank,
        so ranks 1..k always name exactly the top k.
        """
        out: list[SampleLogprobs | None] = [None] * len(ids)
        if logprobs is None:
            return out
        want, tops = self.batch.logprob_rows, self.batch.logprob_counts
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

    def _logit_bias(self, logits: torch.Tensor) -> None:
        """logit_bias: each row's biases added to its tokens' logits."""
        b = self.batch
        if b.bias_rows:
            device = logits.device
            logits.index_put_((b.bias_pair_rows.to(device), b.bias_pair_tokens.to(device)),
                              b.bias_values.to(device), accumulate=True)

    def _allowed_tokens(self, logits: torch.Tensor) -> None:
        """allowed_token_ids: every other token of the row masked (the allowed ones keep their logits)."""
        b = self.batch
        if not b.allowed_rows:
            return
        device = logits.device
        r, t = b.allowed_pair_rows.to(device), b.allowed_pair_tokens.to(device)
        kept = logits[r, t]
        logits.index_fill_(0, torch.tensor(b.allowed_rows, device=device), float("-inf"))
        logits[r, t] = kept

    def _bad_word_tokens(self) -> tuple[list[int], list[list[int]]]:
        """bad_words this step: the rows and, per row, the tokens to mask: every one-token word, and
        the last token of each longer word whose other tokens end the completion's output."""
        b = self.batch
        rows: list[int] = []
        tokens: list[list[int]] = []
        for i in b.bad_words_rows:
            row, out = b.tokens[i], b.rows[i].output_token_ids
            masked = list(row.bad_single)
            for prefix, last in row.bad_prefixed:
                n = len(prefix)
                if len(out) >= n and list(out[-n:]) == prefix:
                    masked.append(last)
            if masked:
                rows.append(i)
                tokens.append(masked)
        return rows, tokens

    def _revive(self, logits: torch.Tensor, given: torch.Tensor, masked: list[int]) -> None:
        """Rows the masks left no token to sample (allowed_token_ids all bad words, or all EOS under
        min_tokens; or all forbidden by the output constraint) take, this step, their biased logits
        with only allowed_token_ids masked, or, where that leaves nothing either, without it: a
        draw from nothing would return an id outside the vocabulary."""
        rows = torch.tensor(masked, device=logits.device)
        dead = rows[torch.isneginf(logits[rows]).all(dim=1)].tolist()
        b = self.batch
        for i in dead:
            row = given[i].clone()
            tokens = b.tokens[i]
            if tokens.bias_ids:
                row[tokens.bias_ids] += torch.tensor(tokens.bias_values, device=row.device)
            if tokens.allowed:
                allowed = torch.full_like(row, float("-inf"))
                allowed[tokens.allowed] = row[tokens.allowed]
                if not torch.isneginf(allowed).all():
                    row = allowed
            logits[i] = row

    def _mask_stop_tokens(self, logits: torch.Tensor, short: list[int]) -> None:
        """min_tokens: a completion cannot end (EOS / stop_token_ids) before it has that many tokens."""
        row_ids = [i for i in short if self.batch.tokens[i].banned]
        if row_ids:
            banned = [self.batch.tokens[i].banned for i in row_ids]
            logits.index_put_(_flat_indices(row_ids, banned, logits.device),
                              torch.tensor(float("-inf"), device=logits.device))

    def _repetition_penalty(self, logits: torch.Tensor) -> None:
        """Tokens seen in prompt or output: positive logits divided by the penalty, others multiplied."""
        b, sel = self.batch, self.batch.repetition_rows
        if not sel:
            return
        tokens = [list(b.rows[i].prompt_token_ids) + list(b.rows[i].output_token_ids) for i in sel]
        r, t = _flat_indices(sel, tokens, logits.device)
        vocab = logits.shape[1]
        pairs = torch.unique(r * vocab + t)  # [P] distinct (row, token): a token is penalised once
        r, t = pairs // vocab, pairs % vocab
        penalty = b.penalties[:, 0].to(logits.device)[r]  # [P]
        seen = logits[r, t]
        logits[r, t] = torch.where(seen > 0, seen / penalty, seen * penalty)

    def _frequency_presence_penalties(self, logits: torch.Tensor) -> None:
        """logit -= frequency_penalty * count + presence_penalty * (count > 0), counts over output tokens."""
        b = self.batch
        sel = [i for i, n in zip(b.frequency_rows, b.output_lengths(b.frequency_rows), strict=True) if n]
        if not sel:
            return
        vocab = logits.shape[1]
        r, t = _flat_indices(sel, [b.rows[i].output_token_ids for i in sel], logits.device)
        pairs, counts = torch.unique(r * vocab + t, return_counts=True)  # distinct (row, token)
        r, t = pairs // vocab, pairs % vocab
        penalties = b.penalties.to(logits.device)[r]  # [P, 3]
        logits[r, t] -= penalties[:, 1] * counts + penalties[:, 2]

    # -- random sampling ------------------------------------------------------------------------

    def _sample(self, logits: torch.Tensor) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p, then one draw per row; logits [M, V] of the batch's
        random rows -> ids [M]."""
        b, device = self.batch, logits.device
        logits = logits / b.temperature.to(device)
        # The filters become one threshold per row ([M, 1], -inf: keep all) that the draw applies
        # as it weighs the tokens: no masked copy of [M, V]. Each runs only on the rows that use it.
        threshold = None
        if b.any_filtered:
            top_k, top_p = b.top_k.to(device), b.top_p.to(device)
            if b.filtered is None:
                threshold = top_k_top_p_threshold(logits, top_k, top_p)
            else:
                threshold = torch.full((logits.shape[0], 1), float("-inf"), device=device)
                threshold[b.filtered] = top_k_top_p_threshold(logits[b.filtered], top_k, top_p)
        if b.min_p is not None:
            # min-p after top-k / top-p: those never mask the largest logit, its reference
            floor = min_p_threshold(logits, b.min_p.to(device))  # [M, 1]
            threshold = floor if threshold is None else torch.maximum(threshold, floor)
        u = torch.rand(logits.shape[0], dtype=torch.float64, generator=self.generator)  # [M]
        if b.seeded_rows:
            # A seeded row's draw is counted by its output position: the same token whatever the batch.
            steps = torch.tensor(b.output_lengths(b.seeded_rows), dtype=torch.int64)
            u[b.seeded] = counter_uniforms(b.seed_keys, steps)
        return sample_from_logits(logits, u, threshold)


def _flat_indices(
    row_ids: Sequence[int], token_lists: Sequence[Sequence[int]], device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) pairs for ``index_put_`` from one token list per row."""
    pairs = zip(row_ids, token_lists, strict=True)
    rows = list(itertools.chain.from_iterable(itertools.repeat(r, len(t)) for r, t in pairs))
    toks = list(itertools.chain.from_iterable(token_lists))
    return (torch.tensor(rows, dtype=torch.long, device=device),
            torch.tensor(toks, dtype=torch.long, device=device))
