"""``Engine``: continuous batching over a paged KV cache; what a worker daemon drives
(it implements :class:`~batchinfer.workers.engine.interface.WorkerEngine`).

``add_request`` validates and queues; each ``step()`` is schedule -> run -> sample ->
postprocess and returns the outputs of the requests that moved. A request whose postprocessing
raises is finished as aborted with its error; the other requests and the loop carry on.

LoRA (``config.lora_enabled``): a ``LoRAManager`` holds the served adapters and gates admission
(a request waits while its adapter loads); requests of different adapters and of the base model
share every step. A request whose adapter fails to load in the background ends aborted with
the loader's error.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from batchinfer.workers.engine.block_manager import BlockManager
from batchinfer.workers.engine.interface import WorkerEngine
from batchinfer.workers.engine.model_runner import ModelRunner
from batchinfer.workers.engine.outputs import (
    CompletionOutput,
    FirstToken,
    RequestOutput,
    SampleLogprobs,
    StepStats,
)
from batchinfer.workers.engine.sampler import Sampler, SamplingRow, make_generator
from batchinfer.workers.engine.sequence import Request, Sequence
from batchinfer.workers.engine.step_scheduler import StepScheduler
from batchinfer.workers.engine_config import EngineConfig
from batchinfer.workers.models import Decoder, load_model
from batchinfer.workers.sampling_params import SamplingParams
from batchinfer.workers.structured.manager import StructuredOutputManager
from batchinfer.workers.text.detokenizer import IncrementalDetokenizer, append_tokens
from batchinfer.workers.text.stopping import check_stop, is_stop_token
from batchinfer.workers.text.tokenizer import Tokenizer
from batchinfer.workers.text.tokenizer_files import read_tokenizer_files

if TYPE_CHECKING:
    from batchinfer.workers.lora.manager import LoRAManager
    from batchinfer.workers.lora_request import LoRARequest

log = logging.getLogger(__name__)


class Engine(WorkerEngine):
    """One model, its KV cache, and the requests sharing them."""

    def __init__(self, config: EngineConfig, model: Decoder | None = None,
                 tokenizer: Tokenizer | None = None) -> None:
        """Load ``config.model`` (or use ``model`` / ``tokenizer`` already loaded) and size the KV cache."""
        self.config = config
        self.ranks = None  # tensor parallelism: the other ranks' processes (workers/engine/tp_ranks.py)
        if model is None and config.tensor_parallel_size > 1:
            from batchinfer.workers.engine.tp_ranks import RankProcesses

            self.ranks = RankProcesses.start(config)  # spawns ranks 1..N-1, loads rank 0's shard
            model = self.ranks.model
        self.model = model if model is not None else load_model(config.model, config.dtype, config.device)
        self.tokenizer = tokenizer if tokenizer is not None else Tokenizer.from_dir(config.model)
        path = Path(config.model)
        self.model_name = path.stem if path.is_file() else path.name  # x.gguf is served as "x"
        self.task = "generate"
        mc = self.model.config
        if config.max_model_len is not None and config.max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's "
                             f"max_position_embeddings {mc.max_position_embeddings}")
        wanted_len = config.max_model_len or mc.max_position_embeddings
        # Adapters are read (and checked) and their stacked weights allocated before the KV cache
        # is sized, so that the cache takes what they leave.
        self.lora: LoRAManager | None = None
        try:
            if config.lora_enabled:
                from batchinfer.workers.lora.manager import LoRAManager

                self.lora = LoRAManager(config, mc, self.model.dtype, self.model.device)
            self.runner = ModelRunner(self.model, config, wanted_len, ranks=self.ranks)
        except BaseException:
            if self.ranks is not None:
                self.ranks.close()
            if self.lora is not None:
                self.lora.close()
            raise
        if self.lora is not None:
            self.runner.lora_stack = self.lora.stack
        self.kv_tokens = self.runner.num_blocks * config.block_size
        if config.max_model_len is not None and config.max_model_len > self.kv_tokens:
            self.runner.close()
            raise ValueError(f"max_model_len {config.max_model_len} does not fit the KV cache of "
                             f"{self.kv_tokens} tokens: raise num_kv_blocks / kv_cache_memory or lower it")
        # A sequence never outgrows the pool, so the oldest one can always run alone.
        self.max_model_len = min(wanted_len, self.kv_tokens)
        self.runner.max_model_len = self.max_model_len
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size,
                                          config.enable_prefix_caching)
        self.scheduler = StepScheduler(self.block_manager, config.max_num_batched_tokens, config.max_num_seqs,
                                       gate=self.lora)
        self.eos_token_ids = sorted({*mc.eos_token_ids, *self.tokenizer.eos_token_ids})
        # Requests that set no seed draw from this engine's own generator, not torch's global one:
        # building an engine leaves the process's RNG alone, and its unseeded draws are still
        # reproducible from ``config.seed``. CPU: the sampler draws its uniforms on the host.
        self.generator = torch.Generator().manual_seed(config.seed)
        self.sampler = Sampler(mc.vocab_size, self.eos_token_ids, generator=self.generator)
        # Structured outputs: the grammar backend is built on the first constrained request.
        self.structured = StructuredOutputManager(config, self.tokenizer, mc.vocab_size, self.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self._pending: list[RequestOutput] = []  # outputs of aborts, handed out by the next step()
        self._next_seq_id = 0
        # Statistics for metrics.
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.num_computed_tokens = 0
        self.step_stats = StepStats()  # the last step's first tokens and generated tokens

    @classmethod
    def from_model(cls, model: str | Path, **config: Any) -> Engine:
        """``Engine.from_model(DIR, dtype=..., num_kv_blocks=...)``: the config's fields as keywords."""
        return cls(EngineConfig(model=str(model), **config))

    # -- requests -------------------------------------------------------------------------------

    def make_request(self, request_id: str, prompt: str | None = None,
                     prompt_token_ids: Seq[int] | None = None,
                     sampling_params: SamplingParams | Mapping[str, Any] | None = None,
                     arrival_time: float | None = None, *, lora: str | LoRARequest | None = None) -> Request:
        """Validate a request without queueing it: ``ValueError`` naming the bad field.

        ``lora``: the name of a served adapter, or a ``LoRARequest`` (served from then on);
        None: the base model."""
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
        ids = _token_ids(prompt_token_ids, self.model.config.vocab_size)
        if sampling_params is None:
            params = SamplingParams()
        elif isinstance(sampling_params, SamplingParams):
            params = sampling_params
        elif isinstance(sampling_params, Mapping):
            params = SamplingParams.from_dict(sampling_params)
        else:
            raise ValueError("sampling_params must be SamplingParams or a dict, "
                             f"got {type(sampling_params).__name__}")
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
                seq.deferred_text = detok  # no step reads its text: decoded once, in _output
            else:
                seq.detokenizer = detok
        return req

    def _resolve_lora(self, lora: str | LoRARequest) -> str:
        if self.lora is None:
            name = getattr(lora, "lora_name", lora)
            raise ValueError(f"lora: adapter {name!r} is not served by this engine; it serves no adapters "
                             "(start it with lora_modules or enable_lora)")
        return self.lora.resolve(lora)

    def enqueue(self, req: Request) -> None:
        """Queue a request built by ``make_request``."""
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in the engine")
        self.requests[req.request_id] = req
        for seq in req.seqs:
            self.scheduler.add(seq)

    def add_request(self, request_id: str, prompt: str | None = None,
                    prompt_token_ids: Seq[int] | None = None,
                    sampling_params: SamplingParams | Mapping[str, Any] | None = None, *,
                    lora: str | LoRARequest | None = None, arrival_time: float | None = None) -> None:
        """Validate and queue one request (``ValueError`` naming the field when it is bad);
        ``lora`` as in ``make_request``."""
        self.enqueue(self.make_request(request_id, prompt, prompt_token_ids, sampling_params, arrival_time,
                                       lora=lora))

    def abort(self, request_id: str) -> None:
        """Stop a request; its final output (finish_reason "abort") comes with the next ``step()``.

        Unknown or finished ids are ignored.
        """
        req = self.requests.get(request_id)
        if req is not None:
            self._finish_request(req, "abort")
            self._pending.append(self._output(req))

    # -- the step loop --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; returns the outputs of requests that got a token or finished (of a
        ``final_only`` request: only the one when it finishes)."""
        outputs, self._pending = self._pending, []
        self.step_stats = stats = StepStats()  # _add_token records first tokens into it
        plan = self.scheduler.schedule()
        if self.lora is not None and self.lora.failed:
            outputs += self._fail_lora_loads(self.lora.take_failed())
        if plan.is_empty:
            if self.lora is not None and self.lora.num_loading:  # nothing runs until an adapter loads
                self.lora.wait(timeout=0.05)
                return outputs
            if self.scheduler.has_unfinished():  # cannot happen: a lone sequence always fits the pool
                raise RuntimeError(f"scheduler made no progress with {self.num_waiting} waiting sequences")
            return outputs
        seqs = [s.seq for s in plan.scheduled if s.samples]
        self.structured.begin(seqs)  # grammar masks fill on a helper thread during the forward
        logits = self.runner.execute(plan.scheduled)  # [N, V] for the sequences that sample
        self.scheduler.commit(plan)
        self.structured.apply(logits)  # constrained rows only, before every sampling stage
        sampled = self.sampler(logits, [self._sampling_row(seq) for seq in seqs])
        generated = self.num_generated_tokens
        outputs += self._postprocess(seqs, sampled.token_ids, sampled.logprobs)
        stats.num_generated_tokens = self.num_generated_tokens - generated
        self.num_steps += 1
        self.num_computed_tokens += plan.num_batched_tokens
        return outputs

    def _fail_lora_loads(self, failed: dict[str, str]) -> list[RequestOutput]:
        """End the waiting requests whose adapter failed to load, as aborted with its error."""
        reqs = {seq.request.request_id: seq.request for seq in self.scheduler.waiting
                if seq.lora in failed and seq.request is not None}
        for req in reqs.values():
            req.error = f"lora adapter {req.lora!r} failed to load: {failed[req.lora or '']}"
            self._finish_request(req, "abort")
        return [self._output(req) for req in reqs.values()]

    @staticmethod
    def _sampling_row(seq: Sequence) -> SamplingRow:
        # Built once per sequence: it holds the live output list, so it is current every step.
        row = seq.sampling_row
        if row is None:
            req = _request_of(seq)
            row = seq.sampling_row = SamplingRow(req.params, req.prompt_token_ids, seq.output_token_ids,
                                                 seq.generator)
        return row

    def _postprocess(self, seqs: list[Sequence], token_ids: list[int],
                     logprobs: list[SampleLogprobs | None]) -> list[RequestOutput]:
        moved: dict[str, Request] = {}
        texts = self._bulk_texts(seqs, token_ids)
        for j, (seq, token, lp) in enumerate(zip(seqs, token_ids, logprobs, strict=True)):
            req = _request_of(seq)
            if seq.is_finished:  # a sibling's failure aborted the whole request
                continue
            try:
                self._append_token(seq, token, lp, texts.get(j))
            except Exception as e:  # noqa: BLE001 - one bad request must not stop the others
                log.exception("request %s failed in postprocessing; aborting it", req.request_id)
                req.error = f"{type(e).__name__}: {e}"
                self._finish_request(req, "abort")
            # A final-only request's output is built once, when it finishes (its last running
            # sequence just did).
            if not req.final_only or (seq.is_finished and req.is_finished):
                moved[req.request_id] = req
        return [self._output(req) for req in moved.values()]

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
                      text: str | None = None) -> None:
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
        if seq.matcher is not None:
            self.structured.jump_forward(seq, self._add_token)

    def _add_token(self, seq: Sequence, token: int, text: str | None = None) -> None:
        """Append one token, advance the grammar, and finish the sequence if it stops here."""
        seq.append_token(token)
        self.num_generated_tokens += 1
        req = _request_of(seq)
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

    def _finish_request(self, req: Request, reason: str) -> None:
        for seq in req.seqs:
            if not seq.is_finished:
                seq.finish_reason = reason
                self.scheduler.finish(seq)
        self.requests.pop(req.request_id, None)

    def _output(self, req: Request) -> RequestOutput:
        finished = req.is_finished
        if finished:
            self.requests.pop(req.request_id, None)
        so = req.params.structured_outputs
        outputs = [
            CompletionOutput(index=s.index, text=self._text(s), token_ids=list(s.output_token_ids),
                             finish_reason=s.finish_reason, stop_reason=s.stop_reason,
                             logprobs=list(s.logprobs) if s.logprobs is not None else None,
                             cumulative_logprob=s.cumulative_logprob,
                             structured=so.kind if so is not None else None,
                             structured_complete=self.structured.complete(s))
            for s in req.seqs
        ]
        return RequestOutput(req.request_id, req.prompt_token_ids, outputs, req.num_cached_tokens,
                             req.prompt, finished, error=req.error)

    @staticmethod
    def _text(seq: Sequence) -> str:
        """The completion's text so far; a deferred one's detokenizer first takes the tokens it
        has not seen, in one decode (without a finishing stop token's, as ``check_stop`` leaves
        it out: without stop strings, a "stop" always ends on a token)."""
        detok = seq.deferred_text
        if detok is None:
            return seq.detokenizer.text if seq.detokenizer is not None else ""
        ids = seq.output_token_ids
        end = len(ids)
        if (seq.finish_reason == "stop" and end
                and not _request_of(seq).params.include_stop_str_in_output):
            end -= 1
        if end > seq.deferred_fed:
            detok.extend(ids[seq.deferred_fed:end])
            seq.deferred_fed = end
        if seq.is_finished:
            detok.flush()
        return detok.text

    def close(self) -> None:
        """Shut down what the engine runs outside this process: its tensor-parallel ranks
        (idempotent; nothing to do without TP). The engine steps no more after it."""
        self.runner.close()
        self.structured.close()  # the mask-fill thread
        if self.lora is not None:
            self.lora.close()  # the adapter loader thread

    # -- state ----------------------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        """True while a request is queued or running, or an abort's output is not handed out yet."""
        return bool(self.requests or self._pending)

    def num_unfinished(self) -> int:
        """Requests queued or running."""
        return len(self.requests)

    def tokenizer_files(self) -> dict[str, bytes]:
        """The model folder's tokenizer files, as a worker registers them for the scheduler."""
        return read_tokenizer_files(self.config.model)

    def capacity(self) -> dict[str, int]:
        """What this engine accepts: the scheduler daemon packs batches to it."""
        return {"max_model_len": self.max_model_len, "max_num_seqs": self.config.max_num_seqs,
                "max_num_batched_tokens": self.config.max_num_batched_tokens, "kv_tokens": self.kv_tokens}

    def lora_adapters(self) -> list[str]:
        """The adapters this engine serves (``add_request(lora=NAME)``), sorted."""
        return [] if self.lora is None else self.lora.served()

    def resident_adapters(self) -> list[str]:
        """The adapters in the forward's weight slots now, sorted."""
        return [] if self.lora is None else self.lora.resident()

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks held by live sequences."""
        return self.block_manager.usage

    @property
    def prefix_hit_rate(self) -> float:
        """Prompt tokens served from the prefix cache / prompt tokens looked up."""
        return self.block_manager.prefix_hit_rate


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


def _request_of(seq: Sequence) -> Request:
    """The request that owns ``seq``: every sequence the engine schedules came from make_request
    (only unit tests of the block manager and the step scheduler build sequences of no request)."""
    if seq.request is None:
        raise RuntimeError(f"{seq!r} belongs to no request")
    return seq.request
