"""Request and sequence state.

A ``Request`` is what a user asked for: one prompt and its ``SamplingParams``. Each of its ``n``
completions is a ``Sequence``: the prompt plus that completion's tokens, how many of them the KV
cache already holds (``num_computed_tokens``) and the blocks that hold them. The scheduler only
ever looks at *tokens owed*, ``num_tokens - num_computed_tokens``: a fresh prompt owes all of its
tokens, a decoding sequence owes the one token it sampled last, a preempted sequence owes
everything again. Siblings of one request are independent sequences with the same prompt, so
prefix caching shares the prompt's full blocks between them.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from batchinfer.workers.engine.outputs import SampleLogprobs
    from batchinfer.workers.sampling_params import SamplingParams
    from batchinfer.workers.structured.backend import Matcher


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # owes tokens and holds no blocks (new or preempted)
    RUNNING = "running"  # holds blocks and is scheduled step after step
    FINISHED = "finished"  # done (stop, length, abort): blocks freed


class Sequence:
    """One completion: prompt + generated tokens, computed-token count and block table."""

    __slots__ = (
        "seq_id", "request", "index", "token_ids", "output_token_ids", "num_prompt_tokens",
        "num_computed_tokens", "block_table", "block_hashes", "num_hashed_blocks", "status",
        "num_cached_tokens", "num_preemptions", "sort_key", "generator", "detokenizer",
        "logprobs", "cumulative_logprob", "finish_reason", "stop_reason", "matcher", "forced_tokens",
        "sampling_row", "lora", "lora_slot", "hash_root", "deferred_text", "deferred_fed",
        "spec_token_ids", "num_draft_tokens", "num_accepted_tokens", "num_prediction_drafts",
        "num_prediction_accepted",
    )

    def __init__(self, seq_id: int, request: Request | None, index: int, prompt_token_ids: list[int],
                 arrival_time: float = 0.0) -> None:
        self.seq_id = seq_id
        self.request = request
        self.index = index  # completion index within its request
        self.token_ids: list[int] = list(prompt_token_ids)  # prompt + output
        self.output_token_ids: list[int] = []
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0  # tokens whose K/V are in (or being written to) the cache
        self.block_table: list[int] = []
        # Chained hashes of the full blocks of token_ids (computed lazily, kept across preemption:
        # the tokens never change) and how many blocks of block_table are registered under them.
        self.block_hashes: list[bytes] = []
        self.num_hashed_blocks = 0
        self.status = SequenceStatus.WAITING
        self.num_cached_tokens: int | None = None  # prefix-cache hit at first scheduling
        self.num_preemptions = 0
        self.sort_key = (arrival_time, seq_id)  # oldest first; the newest is preempted first
        self.generator: Any = None  # torch.Generator of a seeded request
        self.detokenizer: Any = None
        # A final-only completion without stop strings or a grammar: nothing reads its text while
        # it runs, so its detokenizer (here instead of in ``detokenizer``) takes all its tokens in
        # one decode when its output is built; ``deferred_fed`` of them are in it so far.
        self.deferred_text: Any = None
        self.deferred_fed = 0
        # Set (to [] and 0.0) by the engine for a request that asks for logprobs.
        self.logprobs: list[SampleLogprobs] | None = None
        self.cumulative_logprob: float | None = None
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        # Structured outputs: this completion's grammar matcher (None: unconstrained) and the
        # tokens its grammar forces at the current state, when known (None: not computed yet).
        self.matcher: Matcher | None = None
        self.forced_tokens: list[int] | None = None
        # The engine's SamplingRow for this completion, built on its first sampling step and reused
        # (it refers to output_token_ids, which only ever grows in place).
        self.sampling_row: Any = None
        # LoRA: the adapter it runs with (None: the base model), the slot of the stacked weights
        # that holds it while the sequence runs (-1: none), and the parent hash of its first
        # KV block (b"" for the base; an adapter's own root, so adapters never share KV blocks).
        self.lora: str | None = None
        self.lora_slot = -1
        self.hash_root = b""
        # Speculative decoding (batchinfer.workers.spec): the draft tokens proposed for the next
        # step (never part of token_ids until verified), and how many drafts this completion was
        # given and how many of them the target accepted; of them, those its request's prediction
        # drafted (OpenAI's accepted / rejected prediction tokens).
        self.spec_token_ids: list[int] = []
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_prediction_drafts = 0
        self.num_prediction_accepted = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens_owed(self) -> int:
        """Tokens the model still has to run before this sequence can sample again."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, status={self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})")


class Request:
    """One user request: a prompt, its sampling parameters and its ``n`` sequences."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, arrival_time: float, first_seq_id: int) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.final_only = params.final_only  # read for every moved request every step
        self.arrival_time = arrival_time
        self.seqs = [Sequence(first_seq_id + i, self, i, self.prompt_token_ids, arrival_time)
                     for i in range(params.n)]
        self.error: str | None = None  # set when postprocessing failed and the request was aborted
        # the result row's code for ``error``: "invalid_request" when the request's own output
        # constraint failed (its row, never a retry); None: the engine's fault (engine_error, retried)
        self.error_code: str | None = None
        self.lora: str | None = None  # the adapter its sequences run with (None: the base model)
        # params.bad_words as the token sequences the sampler bans (InputProcessor.bad_words_token_ids)
        self.bad_words_token_ids: list[list[int]] = []
        # Speculative decoding: params.prediction tokenised once (None: no predicted output), and
        # the group whose earlier outputs the suffix proposer learns from (the job; None: none).
        self.prediction_token_ids: list[int] | None = None
        self.spec_group: str | None = None

    @property
    def is_finished(self) -> bool:
        seqs = self.seqs
        if len(seqs) == 1:  # asked for every request every step: no generator for the common case
            return seqs[0].status is SequenceStatus.FINISHED
        return all(s.is_finished for s in seqs)

    @property
    def num_cached_tokens(self) -> int:
        return self.seqs[0].num_cached_tokens or 0
