"""The engine's two ends, around the step (vLLM v1's input and output processors).

``InputProcessor`` turns ``add_request``'s arguments into a validated ``Request`` and its
``Sequence``s (tokenised prompt, adapter, grammar matchers, generators, detokenizers), before
anything is queued. ``OutputProcessor`` takes a step's sampled tokens into those sequences
(logprobs, text, stop checks, grammar and jump-forward), finishes the ones that stop, and builds
the ``RequestOutput``s; it holds the table of live requests and the generation statistics.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any, TypeVar

from batchinfer.workers.engine.outputs import (
    CompletionOutput,
    FirstToken,
    RequestOutput,
    SampleLogprobs,
    StepStats,
)
from batchinfer.workers.engine.sampler import SamplingRow, make_generator
from batchinfer.workers.engine.sequence import Request, Sequence
from batchinfer.workers.pooling_params import PoolingParams
from batchinfer.workers.sampling_params import SamplingParams
from batchinfer.workers.structured.backend import StructuredOutputError
from batchinfer.workers.text.detokenizer import IncrementalDetokenizer, append_tokens
from batchinfer.workers.text.stopping import check_stop, is_stop_token

if TYPE_CHECKING:
    from batchinfer.workers.engine.step_scheduler import StepScheduler
    from batchinfer.workers.lora.manager import LoRAManager
    from batchinfer.workers.lora_request import LoRARequest
    from batchinfer.workers.structured.manager import StructuredOutputManager
    from batchinfer.workers.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

P = TypeVar("P", SamplingParams, PoolingParams)


class InputProcessor:
    """Validates and builds requests for one engine (``ValueError`` naming the bad field)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int,
                 structured: StructuredOutputManager, lora: LoRAManager | None,
                 requests: Mapping[str, Request]) -> None:
        """``requests``: the engine's live requests (an id already there is refused)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.structured = structured
        self.lora = lora
        self.requests = requests
        self._next_seq_id = 0

    def make_request(self, request_id: str, prompt: str | None = None,
                     prompt_token_ids: Seq[int] | None = None,
                     sampling_params: SamplingParams | Mapping[str, Any] | None = None,
                     arrival_time: float | None = None, *, lora: str | LoRARequest | None = None,
                     spec_group: str | None = None) -> Request:
        """A validated request, not queued; ``lora`` and ``spec_group`` as in ``Engine.make_request``."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        if (prompt is None) == (prompt_token_ids is None):
            raise ValueError("prompt: give exactly one of prompt and prompt_token_ids")
        if prompt is not None:
            if not isinstance(prompt, str):
                raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
            prompt_token_ids = self.tokenizer.encode(prompt)
        ids = _token_ids(prompt_token_ids, self.vocab_size)
        params = params_of(sampling_params, SamplingParams, "sampling_params")
        self._check_sampling_token_ids(params)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt_token_ids: the prompt has {len(ids)} tokens; max_model_len is "
                             f"{self.max_model_len}, which leaves no room to generate")
        if params.max_tokens is not None and len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"max_tokens: {len(ids)} prompt tokens + max_tokens {params.max_tokens} exceed "
                             f"max_model_len {self.max_model_len}")
        adapter = None if lora is None else self._resolve_lora(lora)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        matchers = None
        if params.structured_outputs is not None:  # compiled (or found cached) before anything is queued
            matchers = self.structured.matchers_for(params.structured_outputs, params.n)
        req = Request(request_id, prompt, ids, params, arrival, self._next_seq_id)
        self._next_seq_id += params.n
        req.lora = adapter
        if spec_group is not None and not isinstance(spec_group, str):
            raise ValueError(f"spec_group must be a string or None, got {type(spec_group).__name__}")
        req.spec_group = spec_group
        if params.prediction:  # tokenised once; the speculative decoder drafts from it
            predicted = self.tokenizer.encode(params.prediction, add_special_tokens=False)
            req.prediction_token_ids = predicted or None
        if params.bad_words:
            req.bad_words_token_ids = self.bad_words_token_ids(params.bad_words)
        for seq in req.seqs:
            if adapter is not None and self.lora is not None:
                seq.lora, seq.hash_root = adapter, self.lora.root(adapter)
            if matchers is not None:
                seq.matcher = matchers[seq.index]
            if params.seed is not None:
                # On the CPU whatever the model's device (see make_generator): the sampler draws one
                # number from it per step, and the draws are the same on every device.
                seq.generator = make_generator(params.seed, seq.index)
            if params.logprobs is not None:
                seq.logprobs, seq.cumulative_logprob = [], 0.0
            detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
            if params.final_only and not params.stop and matchers is None:
                seq.deferred_text = detok  # no step reads its text: decoded once, in output()
            else:
                seq.detokenizer = detok
        return req

    def _check_sampling_token_ids(self, params: SamplingParams) -> None:
        """logit_bias keys and allowed_token_ids within the vocabulary (ValueError naming the field)."""
        for token in params.logit_bias or {}:
            if token >= self.vocab_size:
                raise ValueError(f"logit_bias keys must be token ids in [0, {self.vocab_size}) (the "
                                 f"model's vocabulary), got {token}")
        if params.allowed_token_ids is not None:
            check_token_ids(params.allowed_token_ids, self.vocab_size, "allowed_token_ids")

    def bad_words_token_ids(self, words: Seq[str]) -> list[list[int]]:
        """``bad_words`` as the token sequences the sampler bans (vLLM's): each word encoded without
        special tokens as given and, unless it starts with a space, with one (a word inside the
        text usually tokenises with its leading space); a repeated sequence once."""
        out: list[list[int]] = []
        for word in words:
            for text in (word,) if word.startswith(" ") else (word, " " + word):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out

    def _resolve_lora(self, lora: str | LoRARequest) -> str:
        if self.lora is None:
            name = getattr(lora, "lora_name", lora)
            raise ValueError(f"lora: adapter {name!r} is not served by this engine; it serves no adapters "
                             "(start it with lora_modules or enable_lora)")
        return self.lora.resolve(lora)


class OutputProcessor:
    """Takes each step's sampled tokens into their sequences and builds the requests' outputs."""

    def __init__(self, tokenizer: Tokenizer, eos_token_ids: Seq[int], max_model_len: int,
                 scheduler: StepScheduler, structured: StructuredOutputManager) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.scheduler = scheduler  # a sequence that stops is finished there (its blocks freed)
        self.structured = structured
        self.requests: dict[str, Request] = {}  # live: queued or running
        self.num_generated_tokens = 0
        self.step_stats = StepStats()  # the last step's first tokens and generated tokens

    def begin_step(self) -> StepStats:
        """A new step: fresh ``step_stats`` (``_add_token`` records first tokens into it)."""
        self.step_stats = StepStats()
        return self.step_stats

    def postprocess(self, seqs: list[Sequence], token_ids: list[int],
                    logprobs: list[SampleLogprobs | None]) -> list[RequestOutput]:
        """Append each sampled row's token (``seqs[j]`` got ``token_ids[j]``) and return the
        outputs of the requests that moved. A request that raises here ends aborted with its error;
        the others carry on."""
        return self._postprocess(seqs, token_ids, logprobs, self._bulk_texts(seqs, token_ids))

    def postprocess_verified(self, seqs: list[Sequence], token_ids: list[list[int]],
                             logprobs: list[list[SampleLogprobs | None]]) -> list[RequestOutput]:
        """As ``postprocess``, for a step that verified draft tokens: ``seqs[j]`` gets the tokens
        ``token_ids[j]`` (its accepted drafts and the token after them), one by one, until one
        of them stops it (the rest are dropped)."""
        return self._postprocess(seqs, token_ids, logprobs, {})

    def _postprocess(self, seqs: list[Sequence], token_ids: Seq[int | list[int]], logprobs: Seq[Any],
                     texts: dict[int, str]) -> list[RequestOutput]:
        """``postprocess``'s loop: a row's token, or its list of tokens (with a list of logprobs)."""
        generated = self.num_generated_tokens
        moved: dict[str, Request] = {}
        for j, (seq, token, lp) in enumerate(zip(seqs, token_ids, logprobs, strict=True)):
            req = request_of(seq)
            if seq.is_finished:  # a sibling's failure aborted the whole request
                continue
            try:
                if isinstance(token, int):
                    self._append_token(seq, token, lp, texts.get(j))
                else:
                    last = len(token) - 1
                    for i, (t, one) in enumerate(zip(token, lp, strict=True)):
                        # jump-forward only after the step's last token: the drafts before it were
                        # cut where the grammar forces text (StructuredOutputManager.cut_drafts)
                        self._append_token(seq, t, one, jump=i == last)
                        if seq.is_finished:
                            break
            except StructuredOutputError as e:  # the request's own grammar: its invalid_request row
                log.info("request %s: its output constraint failed after %d tokens; ending it: %s",
                         req.request_id, len(seq.output_token_ids), e)
                req.error = f"structured_outputs: the constraint failed while decoding: {e}"
                req.error_code = "invalid_request"
                self.finish_request(req, "abort")
            except Exception as e:  # noqa: BLE001 - one bad request must not stop the others
                log.exception("request %s failed in postprocessing; aborting it", req.request_id)
                req.error = f"{type(e).__name__}: {e}"
                self.finish_request(req, "abort")
            # A final-only request's output is built once, when it finishes (its last running
            # sequence just did).
            if not req.final_only or (seq.is_finished and req.is_finished):
                moved[req.request_id] = req
        self.step_stats.num_generated_tokens = self.num_generated_tokens - generated
        return [self.output(req) for req in moved.values()]

    def fail_lora_loads(self, failed: dict[str, str]) -> list[RequestOutput]:
        """End the waiting requests whose adapter failed to load, as aborted with its error."""
        reqs = {seq.request.request_id: seq.request for seq in self.scheduler.waiting
                if seq.lora in failed and seq.request is not None}
        for req in reqs.values():
            req.error = f"lora adapter {req.lora!r} failed to load: {failed[req.lora or '']}"
            self.finish_request(req, "abort")
        return [self.output(req) for req in reqs.values()]

    def _bulk_texts(self, seqs: list[Sequence], token_ids: list[int]) -> dict[int, str]:
        """The new tokens' texts, detokenised in two batched decodes for the rows that allow it:
        {row: text its token added}. The others (stop tokens, grammar-constrained or n > 1
        requests, a decode that raised) are detokenised one by one in ``_add_token``."""
        rows, detoks, tokens = [], [], []
        eos = self.eos_token_ids
        for j, (seq, token) in enumerate(zip(seqs, token_ids, strict=True)):
            req = seq.request
            # n > 1: a sibling's failure may abort the request before this row is reached.
            if (seq.detokenizer is None or req is None or seq.is_finished or seq.matcher is not None
                    or len(req.seqs) != 1
                    or is_stop_token(len(seq.output_token_ids) + 1, token, req.params, eos)):
                continue
            rows.append(j)
            detoks.append(seq.detokenizer)
            tokens.append(token)
        if not rows:
            return {}
        try:
            return dict(zip(rows, append_tokens(detoks, tokens), strict=True))
        except Exception:  # noqa: BLE001 - nothing changed: each row decodes on its own, failing alone
            log.debug("bulk detokenisation failed; decoding row by row", exc_info=True)
            return {}

    def _append_token(self, seq: Sequence, token: int, logprobs: SampleLogprobs | None,
                      text: str | None = None, jump: bool = True) -> None:
        """Add a sampled token (then, under jump-forward, the tokens its grammar forces after it),
        grow the text, and finish the sequence if it stops here. ``text``: what the token added to
        the text when ``_bulk_texts`` detokenised it already."""
        # The sampler gives logprobs to exactly the rows whose params ask for them, the sequences
        # whose ``logprobs`` list make_request created.
        if seq.logprobs is not None and logprobs is not None:
            for token_id, lp in logprobs.items():  # decoded here: only requests that asked pay for it
                lp.decoded_token, lp.token_bytes = self.tokenizer.decode_token(token_id)
            seq.logprobs.append(logprobs)
            seq.cumulative_logprob = (seq.cumulative_logprob or 0.0) + logprobs[token].logprob
        self._add_token(seq, token, text)
        if seq.matcher is not None and jump:
            self.structured.jump_forward(seq, self._add_token)

    def _add_token(self, seq: Sequence, token: int, text: str | None = None) -> None:
        """Append one token, advance the grammar, and finish the sequence if it stops here."""
        seq.append_token(token)
        self.num_generated_tokens += 1
        req = request_of(seq)
        if len(seq.output_token_ids) == 1 and (len(req.seqs) == 1
                                               or sum(len(s.output_token_ids) for s in req.seqs) == 1):
            # The request's first token (of any of its n completions): its TTFT event, once.
            self.step_stats.first_tokens.append(FirstToken(req.request_id, len(req.prompt_token_ids),
                                                           req.num_cached_tokens, time.monotonic()))
        params = req.params
        stop = check_stop(seq.output_token_ids, token, params, self.eos_token_ids, seq.detokenizer,
                          max_len_reached=seq.num_tokens >= self.max_model_len, new_text=text)
        if seq.matcher is not None:
            stop = self.structured.accept(seq, token, stop)
        if stop is not None:
            seq.finish_reason, seq.stop_reason = stop.finish_reason, stop.stop_reason
            self.scheduler.finish(seq)

    def finish_request(self, req: Request, reason: str) -> None:
        """Finish every running or waiting sequence of ``req`` with ``reason``; it leaves the table."""
        for seq in req.seqs:
            if not seq.is_finished:
                seq.finish_reason = reason
                self.scheduler.finish(seq)
        self.requests.pop(req.request_id, None)

    def output(self, req: Request) -> RequestOutput:
        """``req``'s output now (a finished request leaves the table)."""
        finished = req.is_finished
        if finished:
            self.requests.pop(req.request_id, None)
        so = req.params.structured_outputs
        predicted = req.params.prediction is not None  # its completions report prediction usage
        outputs = [
            CompletionOutput(index=s.index, text=_text(s), token_ids=list(s.output_token_ids),
                             finish_reason=s.finish_reason, stop_reason=s.stop_reason,
                             logprobs=list(s.logprobs) if s.logprobs is not None else None,
                             cumulative_logprob=s.cumulative_logprob,
                             structured=so.kind if so is not None else None,
                             structured_complete=self.structured.complete(s),
                             accepted_prediction_tokens=s.num_prediction_accepted if predicted else None,
                             rejected_prediction_tokens=(s.num_prediction_drafts - s.num_prediction_accepted
                                                         if predicted else None))
            for s in req.seqs
        ]
        return RequestOutput(req.request_id, req.prompt_token_ids, outputs, req.num_cached_tokens,
                             req.prompt, finished, error=req.error, error_code=req.error_code)


def _text(seq: Sequence) -> str:
    """The completion's text so far; a deferred one's detokenizer first takes the tokens it has
    not seen, in one decode (without a finishing stop token's, as ``check_stop`` leaves it out:
    without stop strings, a "stop" always ends on a token)."""
    detok = seq.deferred_text
    if detok is None:
        return seq.detokenizer.text if seq.detokenizer is not None else ""
    ids = seq.output_token_ids
    end = len(ids)
    if (seq.finish_reason == "stop" and end
            and not request_of(seq).params.include_stop_str_in_output):
        end -= 1
    if end > seq.deferred_fed:
        detok.extend(ids[seq.deferred_fed:end])
        seq.deferred_fed = end
    if seq.is_finished:
        detok.flush()
    return detok.text


def sampling_row(seq: Sequence) -> SamplingRow:
    """What the sampler needs of ``seq``: built once per sequence, it holds the live output list,
    so it is current every step."""
    row = seq.sampling_row
    if row is None:
        req = request_of(seq)
        row = seq.sampling_row = SamplingRow(req.params, req.prompt_token_ids, seq.output_token_ids,
                                             seq.generator, req.bad_words_token_ids)
    return row


def draft_rows(seq: Sequence, drafts: list[int]) -> list[SamplingRow]:
    """The sampling rows of ``seq``'s draft positions: row i samples the token after
    ``drafts[:i + 1]``, so it sees them as output already (penalties, ``min_tokens``, bad words and
    a seeded draw's position all count them)."""
    req, out = request_of(seq), seq.output_token_ids
    return [SamplingRow(req.params, req.prompt_token_ids, out + drafts[:i + 1], seq.generator,
                        req.bad_words_token_ids) for i in range(len(drafts))]


def params_of(value: Any, cls: type[P], name: str) -> P:
    """A request's ``name`` argument as ``cls`` (SamplingParams or PoolingParams): None -> the
    defaults, a dict -> ``cls.from_dict``; anything else is a ValueError naming ``name``."""
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if isinstance(value, Mapping):
        return cls.from_dict(value)
    raise ValueError(f"{name} must be {cls.__name__} or a dict, got {type(value).__name__}")


def _token_ids(ids: Any, vocab_size: int) -> list[int]:
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"prompt_token_ids must be a list of integers, got {type(ids).__name__}")
    if not ids:
        raise ValueError("prompt_token_ids must not be empty")
    check_token_ids(ids, vocab_size, "prompt_token_ids")
    return list(ids)


def check_token_ids(ids: Seq[Any], vocab_size: int, where: str) -> None:
    """``ValueError`` naming ``where[i]`` for the first element that is not a token id of the
    vocabulary (a bool is not an int here)."""
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise ValueError(f"{where}[{i}] must be a token id in [0, {vocab_size}), got {t!r}")


def request_of(seq: Sequence) -> Request:
    """The request that owns ``seq``: every sequence the engine schedules came from make_request
    (only unit tests of the block manager and the step scheduler build sequences of no request)."""
    if seq.request is None:
        raise RuntimeError(f"{seq!r} belongs to no request")
    return seq.request
