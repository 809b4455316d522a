"""``WorkerEngine``: the engine interface a worker daemon drives.

Three classes implement it: :class:`~batchinfer.workers.engine.engine.Engine` (a generating
model on a paged KV cache), :class:`~batchinfer.workers.engine.embedder.EmbeddingEngine` (an
embedding model: whole inputs per step, no KV cache) and
:class:`~batchinfer.workers.service.echo_engine.EchoEngine` (no model: echoes prompts); the worker
service's :class:`~batchinfer.workers.service.daemon.WorkerDaemon` (and the managers it composes) uses
nothing else of an engine. Its loop is nano-vllm's: ``add_request`` what fits, ``step()`` while
``has_unfinished()``, publish each finished output. This module imports no torch: an echo worker
never loads it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from batchinfer.workers.engine.outputs import PooledRequestOutput, RequestOutput, StepStats
from batchinfer.workers.sampling_params import SamplingParams


@runtime_checkable
class WorkerEngine(Protocol):
    """What :class:`~batchinfer.workers.service.daemon.WorkerDaemon` relies on; see each member."""

    # Implementations subclass this class to say so; its plain attributes below are set by their
    # constructors (the protocol declares them without values, so nothing here shadows them).

    # -- identity, registered once at start ------------------------------------------------------

    task: str
    """``"generate"`` (completions: :class:`RequestOutput`) or ``"embed"`` (vectors:
    :class:`~batchinfer.workers.engine.outputs.PooledRequestOutput`). An ``"embed"`` engine's
    ``add_request`` also takes ``inputs`` (a list of token-id lists: one vector each) and
    ``pooling_params`` (``PoolingParams`` or its dict) as keywords, instead of sampling parameters;
    it also has ``embedding_dim`` (the width of its vectors) and ``matryoshka`` (whether a request
    may ask for fewer ``dimensions``). Registered with the model, so that the scheduler routes
    ``/v1/embeddings`` lines only to embedding workers."""

    model_name: str
    """The model name batches are routed by (``{p}:batches:<model_name>``) unless the daemon is
    given one."""

    eos_token_ids: Sequence[int]
    """Token ids that end a completion; registered so the scheduler can check requests."""

    def tokenizer_files(self) -> dict[str, bytes]:
        """The tokenizer files (``tokenizer.json`` at least) the worker registers, so that the
        scheduler tokenises and renders chats exactly as this engine decodes."""
        ...

    def capacity(self) -> dict[str, int]:
        """``max_model_len``, ``max_num_seqs``, ``max_num_batched_tokens``, ``kv_tokens``: what the
        scheduler packs batches to. Read once; ``max_num_seqs`` bounds the requests the daemon
        puts into the engine at a time."""
        ...

    def lora_adapters(self) -> list[str]:
        """Names of the LoRA adapters this engine serves (``add_request(lora=NAME)``), sorted;
        the worker registers each as model ``BASE:NAME``. Empty for an engine without adapters."""
        ...

    def resident_adapters(self) -> list[str]:
        """The adapters loaded in the forward's weights now (a subset of ``lora_adapters``), which
        the worker reports so that batches of them prefer it (cache affinity)."""
        ...

    # -- requests ---------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | None = None,
                    prompt_token_ids: Sequence[int] | None = None,
                    sampling_params: SamplingParams | Mapping[str, Any] | None = None, *,
                    lora: str | None = None, spec_group: str | None = None) -> None:
        """Queue one request under a fresh ``request_id``, with the served adapter named ``lora``
        (None: the base model; a name it does not serve is a ValueError). ``spec_group``: the job the
        request belongs to, whose finished outputs speculative decoding may draft from (an engine
        that does not speculate ignores it). ``ValueError`` (with a message naming the field) means
        the request itself is bad: the daemon publishes it as ``invalid_request``; any other
        exception counts as an engine failure of that request."""
        ...

    def abort(self, request_id: str) -> None:
        """Stop a request; its final output (``finish_reason "abort"``) comes with the next
        ``step()``. Unknown or finished ids are ignored."""
        ...

    # -- the step loop ----------------------------------------------------------------------------

    def step(self) -> Sequence[RequestOutput] | Sequence[PooledRequestOutput]:
        """Advance every running request by one step; return the outputs of the requests that moved
        (``RequestOutput`` for ``task == "generate"``, finished ``PooledRequestOutput`` for ``"embed"``).

        An output with ``finished`` set is final: the daemon publishes it (or, when its ``error``
        is set, counts an engine failure of that request). A raise means the step failed with
        nothing finished: the daemon bisects the running requests to find the culprit.
        """
        ...

    def has_unfinished(self) -> bool:
        """True while a request is queued, running, or has an output (an abort) not yet handed out
        by ``step()``: the daemon steps while this holds."""
        ...

    def num_unfinished(self) -> int:
        """Requests in the engine (queued or running); ``max_num_seqs`` minus this is the room the
        daemon fills."""
        ...

    # -- statistics for metrics, read after each step ---------------------------------------------

    @property
    def num_running(self) -> int:
        """Requests being computed now (an engine without a waiting queue counts all of them)."""
        ...

    @property
    def num_waiting(self) -> int:
        """Requests queued but not running (0 for an engine without a waiting queue)."""
        ...

    @property
    def num_preemptions(self) -> int:
        """Preemptions since the engine started (cumulative; 0 for an engine that never preempts)."""
        ...

    @property
    def kv_usage(self) -> float | None:
        """Fraction (0..1) of the KV cache held by live requests; None for an engine without one."""
        ...

    def spec_stats(self) -> dict[str, Any]:
        """Speculative decoding's counters since the engine started (cumulative), ``{}`` when it never
        speculates: ``{"methods": {METHOD: {"drafts", "draft_tokens", "accepted_tokens"}}, "steps",
        "disabled_steps"}`` — per proposer method (``ngram``, ``suffix``, ``prediction``, ``draft``)
        the sequence-steps that carried drafts, the draft tokens verified and those accepted; the
        steps that verified a draft and those the batch-size switch kept from drafting."""
        ...

    num_computed_tokens: int
    """Tokens computed since the engine started (cumulative); its growth over a step is the step's
    batch size in tokens."""

    step_stats: StepStats
    """What the last ``step()`` did: the requests whose first token came out in it (request id,
    prompt length, cached prompt tokens, time) and the tokens it generated. A generating engine's
    ``step()`` sets a new object each time (a step that raises may leave it partly filled). The
    daemon's metrics read it instead of per-step outputs, so its generation requests run
    ``final_only``; an engine that generates nothing (``"embed"``) reports no first tokens and 0
    tokens (its prompt tokens count from its finished outputs)."""


class ModelFolderState:
    """``has_unfinished`` / ``num_unfinished`` / ``tokenizer_files`` of an engine over a model folder
    (``config.model``) that keeps its live requests in ``requests`` and the outputs of aborts not yet
    handed out in ``_pending`` (:class:`Engine` and :class:`EmbeddingEngine`)."""

    requests: Mapping[str, Any]
    _pending: list[Any]
    config: Any

    def has_unfinished(self) -> bool:
        """True while a request is queued or running, or an abort's output is not handed out yet."""
        return bool(self.requests or self._pending)

    def num_unfinished(self) -> int:
        """Requests queued or running."""
        return len(self.requests)

    def tokenizer_files(self) -> dict[str, bytes]:
        """The model folder's tokenizer files, as a worker registers them for the scheduler."""
        from batchinfer.workers.text.tokenizer_files import read_tokenizer_files

        return read_tokenizer_files(self.config.model)


class NoQueueStats:
    """The statistics of an engine with no waiting queue, no preemption, no KV cache and no
    speculation (the embedding and echo engines): every unanswered request counts as running."""

    def num_unfinished(self) -> int:
        """The engine's own (every class that mixes this in defines it)."""
        raise NotImplementedError

    @property
    def num_running(self) -> int:
        return self.num_unfinished()

    @property
    def num_waiting(self) -> int:
        return 0

    @property
    def num_preemptions(self) -> int:
        return 0

    @property
    def kv_usage(self) -> float | None:
        return None

    def spec_stats(self) -> dict[str, Any]:
        return {}
