"""``Engine``: continuous batching over a paged KV cache; what a worker daemon drives
(it implements :class:`~batchinfer.workers.engine.interface.WorkerEngine`).

The engine orchestrates named collaborators: ``add_request`` goes through the
``InputProcessor`` (validate, tokenise, build the sequences) into the ``StepScheduler``; each
``step()`` is schedule -> execute (``ModelRunner``) -> structured mask
(``StructuredOutputManager``) -> sample (``Sampler``) -> postprocess (``OutputProcessor``:
tokens, text, stops, outputs), and returns the outputs of the requests that moved. A request
whose postprocessing raises is finished as aborted with its error; the other requests and the
loop carry on.

LoRA (``config.lora.enabled``): a ``LoRAManager`` holds the served adapters and gates admission
(a request waits while its adapter loads); requests of different adapters and of the base model
share every step. A request whose adapter fails to load in the background ends aborted with
the loader's error.

Speculative decoding (``workers/spec``): before scheduling, the ``SpecDecoder`` proposes draft
tokens for decoding sequences; the step runs them after each one's owed token, samples every
position, keeps the drafts the target sampled itself and the token after them, and frees the
blocks of the rest. Outputs are the same tokens as without it; only the number of steps changes.

Quantization (``config.quantization``, ``workers/quant``): right after loading, the layers'
projections and the LM head are swapped for int8 / int4 ``QuantizedLinear`` modules (``auto``
settled from the GGUF's tensor types first); the model then runs in bfloat16.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from batchinfer.workers.engine.block_manager import BlockManager
from batchinfer.workers.engine.interface import ModelFolderState, WorkerEngine
from batchinfer.workers.engine.model_runner import ModelRunner
from batchinfer.workers.engine.outputs import RequestOutput, SampleLogprobs
from batchinfer.workers.engine.processors import InputProcessor, OutputProcessor, draft_rows, sampling_row
from batchinfer.workers.engine.sampler import Sampler
from batchinfer.workers.engine.sequence import Request, Sequence
from batchinfer.workers.engine.step_scheduler import ScheduledSequence, StepScheduler
from batchinfer.workers.engine_config import EngineConfig
from batchinfer.workers.models import Decoder, ModelConfig, load_model
from batchinfer.workers.quant.apply import quantize_model
from batchinfer.workers.quant.dense import use_gemv
from batchinfer.workers.quant.layer_loop import use_layer_loop
from batchinfer.workers.quant.plan import plan_quantization
from batchinfer.workers.quantization_config import quantized_dtype
from batchinfer.workers.sampling_params import SamplingParams
from batchinfer.workers.spec.decoder import SpecDecoder, num_accepted
from batchinfer.workers.spec.draft import EngineParts
from batchinfer.workers.speculative_config import SpeculativeConfig
from batchinfer.workers.structured.manager import StructuredOutputManager
from batchinfer.workers.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from batchinfer.workers.lora.manager import LoRAManager
    from batchinfer.workers.lora_request import LoRARequest


class Engine(ModelFolderState, WorkerEngine):
    """One model, its KV cache, and the requests sharing them."""

    def __init__(self, config: EngineConfig, model: Decoder | None = None,
                 tokenizer: Tokenizer | None = None) -> None:
        """Load ``config.model`` (or use ``model`` / ``tokenizer`` already loaded) and size the KV cache."""
        # Quantization (workers/quant): "auto" is settled from the checkpoint's tensor types; a
        # quantized model runs in bfloat16 (int8 / int4 already made the config's dtype that).
        self.quantization = plan_quantization(config.quantization, config.model, config.device,
                                              config.tensor_parallel_size)
        if self.quantization.active and config.dtype != torch.bfloat16:
            config = dataclasses.replace(config, dtype=quantized_dtype(config.quantization, config.dtype))
        self.config = config
        self.ranks = None  # tensor parallelism: the other ranks' processes (workers/engine/tp_ranks.py)
        if model is None and config.tensor_parallel_size > 1:
            from batchinfer.workers.engine.tp_ranks import RankProcesses

            self.ranks = RankProcesses.start(config)  # spawns ranks 1..N-1, loads rank 0's shard
            model = self.ranks.model
        self.model = model if model is not None else load_model(config.model, config.dtype, config.device)
        if self.quantization.active:  # right after loading: the KV cache is sized on what it leaves
            if self.model.dtype != torch.bfloat16:  # a model handed in, quantized in place
                raise ValueError(f"quantization {config.quantization!r} runs in bfloat16; the model handed "
                                 f"in is {self.model.dtype}: load it in bfloat16 (or let the engine load it)")
            quantize_model(self.model, self.quantization.layers, self.quantization.head)
        use_gemv(self.model)  # CPU: few-row matmuls on the compiled GEMV
        use_layer_loop(self.model)  # CPU decode steps: the layers in one compiled call
        self.tokenizer = tokenizer if tokenizer is not None else Tokenizer.from_dir(config.model)
        path = Path(config.model)
        self.model_name = path.stem if path.is_file() else path.name  # x.gguf is served as "x"
        self.task = "generate"
        mc = self.model.config
        self._build_runner(mc)  # self.lora, self.runner, self.kv_tokens, self.max_model_len
        self.block_manager = BlockManager.from_config(self.runner.num_blocks, config.cache)
        self.scheduler = StepScheduler.from_config(self.block_manager, config.scheduler, gate=self.lora)
        eos = sorted({*mc.eos_token_ids, *self.tokenizer.eos_token_ids})
        # Requests that set no seed draw from this engine's own generator, not torch's global one:
        # building an engine leaves the process's RNG alone, and its unseeded draws are still
        # reproducible from ``config.seed``. CPU: the sampler draws its uniforms on the host.
        self.generator = torch.Generator().manual_seed(config.seed)
        self.sampler = Sampler(mc.vocab_size, eos, generator=self.generator)
        # Structured outputs: the grammar backend is built on the first constrained request.
        self.structured = StructuredOutputManager(config.structured, self.tokenizer, mc.vocab_size, eos,
                                                  config.max_num_seqs)
        self.output_processor = OutputProcessor(self.tokenizer, eos, self.max_model_len, self.scheduler,
                                                self.structured)
        self.requests: dict[str, Request] = self.output_processor.requests  # queued or running
        self.spec = self._build_spec(config, mc.vocab_size)
        self.input_processor = InputProcessor(self.tokenizer, mc.vocab_size, self.max_model_len,
                                              self.structured, self.lora, self.requests)
        self._pending: list[RequestOutput] = []  # outputs of aborts, handed out by the next step()
        # Statistics for metrics (the generated tokens are counted by the output processor).
        self.num_steps = 0
        self.num_computed_tokens = 0
        self.step_stats = self.output_processor.step_stats  # the last step's first and generated tokens

    def _build_runner(self, mc: ModelConfig) -> None:
        """The adapters, then the model runner and its KV cache, and the model length it leaves.

        Adapters are read (and checked) and their stacked weights allocated before the KV cache
        is sized, so that the cache takes what they leave."""
        config, lora, asked_len = self.config, self.config.lora, self.config.max_model_len
        if asked_len is not None and asked_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len {asked_len} exceeds the model's "
                             f"max_position_embeddings {mc.max_position_embeddings}")
        wanted_len = asked_len or mc.max_position_embeddings
        self.lora: LoRAManager | None = None
        try:
            if lora.enabled:
                from batchinfer.workers.lora.manager import LoRAManager

                self.lora = LoRAManager(lora, mc, self.model.dtype, self.model.device)
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
        if asked_len is not None and asked_len > self.kv_tokens:
            self.runner.close()
            raise ValueError(f"max_model_len {asked_len} does not fit the KV cache of "
                             f"{self.kv_tokens} tokens: raise num_kv_blocks / kv_cache_memory or lower it")
        # A sequence never outgrows the pool, so the oldest one can always run alone.
        self.max_model_len = min(wanted_len, self.kv_tokens)
        self.runner.max_model_len = self.max_model_len

    def _build_spec(self, config: EngineConfig, vocab_size: int) -> SpecDecoder | None:
        """The speculative decoder: ``config.speculative_config``'s method and, unless it turns
        them off, requests' own predicted outputs (also with no config). None: nothing speculates."""
        spec_config = config.speculative_config or SpeculativeConfig()
        if spec_config.method is None and not spec_config.use_predictions:
            return None
        # The draft model's proposer runs the engine's own parts (handed in: spec imports no engine)
        parts = EngineParts(ModelRunner, BlockManager, Sequence, ScheduledSequence)
        spec = SpecDecoder.build(spec_config, max_model_len=self.max_model_len, engine_config=config,
                                 tokenizer=self.tokenizer, vocab_size=vocab_size, engine_parts=parts)
        self.scheduler.on_finish = spec.release
        spec.cut = self.structured.cut_drafts  # a constrained completion's drafts end where its grammar says
        return spec

    @classmethod
    def from_model(cls, model: str | Path, **config: Any) -> Engine:
        """``Engine.from_model(DIR, dtype=..., num_kv_blocks=...)``: the config's fields as keywords."""
        return cls(EngineConfig(model=str(model), **config))

    # -- requests -------------------------------------------------------------------------------

    def make_request(self, request_id: str, prompt: str | None = None,
                     prompt_token_ids: Seq[int] | None = None,
                     sampling_params: SamplingParams | Mapping[str, Any] | None = None,
                     arrival_time: float | None = None, *, lora: str | LoRARequest | None = None,
                     spec_group: str | None = None) -> Request:
        """Validate a request without queueing it: ``ValueError`` naming the bad field.

        ``lora``: the name of a served adapter, or a ``LoRARequest`` (served from then on);
        None: the base model. ``spec_group``: the group (the worker's job id) whose finished outputs
        the suffix proposer drafts from; None: none."""
        return self.input_processor.make_request(request_id, prompt, prompt_token_ids, sampling_params,
                                                 arrival_time, lora=lora, spec_group=spec_group)

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
                    lora: str | LoRARequest | None = None, spec_group: str | None = None,
                    arrival_time: float | None = None) -> None:
        """Validate and queue one request (``ValueError`` naming the field when it is bad);
        ``lora`` and ``spec_group`` as in ``make_request``."""
        self.enqueue(self.make_request(request_id, prompt, prompt_token_ids, sampling_params, arrival_time,
                                       lora=lora, spec_group=spec_group))

    def abort(self, request_id: str) -> None:
        """Stop a request; its final output (finish_reason "abort") comes with the next ``step()``.

        Unknown or finished ids are ignored.
        """
        req = self.requests.get(request_id)
        if req is not None:
            self.output_processor.finish_request(req, "abort")
            self._pending.append(self.output_processor.output(req))

    # -- the step loop --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; returns the outputs of requests that got a token or finished (of a
        ``final_only`` request: only the one when it finishes)."""
        outputs, self._pending = self._pending, []
        self.step_stats = self.output_processor.begin_step()  # postprocessing records into it
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)  # drafts for the decoding sequences
        plan = self.scheduler.schedule()  # who runs how many tokens; their blocks are allocated
        outputs += self._lora_failures()
        if plan.is_empty:
            self._idle()
            return outputs
        sampling = [s for s in plan.scheduled if s.samples]
        seqs = [s.seq for s in sampling]  # the sampling sequences, in logits order
        verifies = any(s.spec_token_ids for s in sampling)
        # grammar masks fill on a helper thread during the forward (k drafts: k + 1 rows)
        self.structured.begin(seqs, [s.spec_token_ids for s in sampling] if verifies else None)
        logits = self.runner.execute(plan.scheduled)  # [N, V]: a row per sampling position
        self.scheduler.commit(plan)  # those tokens are now in the KV cache (drafts once verified)
        self.structured.apply(logits)  # constrained rows only, before every sampling stage
        if verifies:
            outputs += self._verify(sampling, logits)
        else:
            sampled = self.sampler(logits, [sampling_row(seq) for seq in seqs])
            outputs += self.output_processor.postprocess(seqs, sampled.token_ids, sampled.logprobs)
        self.num_steps += 1
        self.num_computed_tokens += plan.num_batched_tokens
        return outputs

    def _verify(self, sampling: list[ScheduledSequence], logits: torch.Tensor) -> list[RequestOutput]:
        """Sample every position of a step that ran draft tokens and keep, per sequence, the drafts
        the target sampled itself and the token after them (``SpecDecoder``'s accept rule)."""
        assert self.spec is not None
        rows = []
        for s in sampling:
            rows.append(sampling_row(s.seq))
            if s.spec_token_ids:
                rows += draft_rows(s.seq, s.spec_token_ids)
        sampled = self.sampler(logits, rows)
        tokens: list[list[int]] = []
        logprobs: list[list[SampleLogprobs | None]] = []
        accepted: list[int] = []
        i = 0
        for s in sampling:
            n = 1 + len(s.spec_token_ids)
            ids = sampled.token_ids[i:i + n]
            a = num_accepted(s.spec_token_ids, ids)
            tokens.append(ids[:a + 1])
            logprobs.append(sampled.logprobs[i:i + a + 1])
            accepted.append(a)
            i += n
        outputs = self.output_processor.postprocess_verified([s.seq for s in sampling], tokens, logprobs)
        for s, a in zip(sampling, accepted, strict=True):
            if s.spec_token_ids:
                self.spec.record(s.seq, len(s.spec_token_ids), a)
                self.scheduler.accept_drafts(s.seq, a)
        self.spec.step_verified()
        return outputs

    def spec_stats(self) -> dict[str, Any]:
        """Speculative decoding's cumulative counters ({} when this engine does not speculate):
        ``{"methods": {method: {"drafts", "draft_tokens", "accepted_tokens"}}, "steps",
        "disabled_steps"}``."""
        return {} if self.spec is None else self.spec.summary()

    def _lora_failures(self) -> list[RequestOutput]:
        """The outputs of the waiting requests whose adapter failed to load (they end aborted)."""
        if self.lora is None or not self.lora.failed:
            return []
        return self.output_processor.fail_lora_loads(self.lora.take_failed())

    def _idle(self) -> None:
        """A step that ran nothing: wait a little while an adapter load holds everything back."""
        if self.lora is not None and self.lora.num_loading:
            self.lora.wait(timeout=0.05)
        elif self.scheduler.has_unfinished():  # cannot happen: a lone sequence always fits the pool
            raise RuntimeError(f"scheduler made no progress with {self.num_waiting} waiting sequences")

    def close(self) -> None:
        """Shut down what the engine runs outside this process: its tensor-parallel ranks
        (idempotent; nothing to do without TP). The engine steps no more after it."""
        self.runner.close()
        self.structured.close()  # the mask-fill thread
        if self.lora is not None:
            self.lora.close()  # the adapter loader thread

    # -- state ----------------------------------------------------------------------------------

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
    def eos_token_ids(self) -> Seq[int]:
        """The token ids that end a completion (the model's and the tokenizer's)."""
        return self.output_processor.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: Seq[int]) -> None:  # stop checks from then on (tests set it)
        self.output_processor.eos_token_ids = ids

    @property
    def num_generated_tokens(self) -> int:
        """Tokens appended to completions so far (sampled and forced)."""
        return self.output_processor.num_generated_tokens

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

