"""What the engine hands back: one ``RequestOutput`` per request, ``n`` completions each."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple


@dataclass
class Logprob:
    """One token's logprob in a step's raw distribution, as vLLM's ``Logprob``.

    ``rank`` is 1-based (1 = the most likely token); the top-k tokens of a step hold ranks 1..k
    and a sampled token outside them a rank above k. ``decoded_token`` is the token decoded alone
    (special tokens kept, as vLLM does), which is U+FFFD for a byte-level token that holds part of
    a UTF-8 character; ``token_bytes`` (not in vLLM) are the token's own bytes, what OpenAI's
    ``bytes`` field reports.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None
    token_bytes: bytes | None = None


#: One generated token's logprobs: token id -> Logprob, the sampled token first, then the top-k.
SampleLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One of a request's ``n`` completions."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    # One dict per generated token when logprobs were asked for (SamplingParams.logprobs set).
    logprobs: list[SampleLogprobs] | None = None
    # Sum of the sampled tokens' logprobs; None when logprobs were not asked for.
    cumulative_logprob: float | None = None
    # Structured outputs: the constraint's kind ("json", "regex", "choice", "grammar",
    # "json_object"; None when unconstrained) and whether the text is a complete match of it
    # (False when max_tokens / the context / an abort cut it short; None when unconstrained).
    structured: str | None = None
    structured_complete: bool | None = None
    # The completion's tool calls when the request had tools (OpenAI's shape: ``{"id", "type":
    # "function", "function": {"name", "arguments"}}``; ``text`` is then the content outside the
    # calls); None without tools or when no call was made. Set by ``LLM.chat(tools=...)``.
    tool_calls: list[dict[str, Any]] | None = None
    # Predicted outputs (``SamplingParams.prediction``): the prediction's draft tokens the model
    # kept and those it verified and rejected; None when the request gave no prediction.
    accepted_prediction_tokens: int | None = None
    rejected_prediction_tokens: int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's state as of the last step; ``finished`` once every completion is."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    prompt: str | None = None
    finished: bool = False
    # Set when the engine finished this request as aborted because it failed (e.g. an exception
    # while processing it); the worker daemon publishes it as an ``engine_error`` row (after its
    # retries), or with ``error_code`` as that code's row at once: "invalid_request" when the
    # request's own grammar failed mid-decode (a parser or lexer limit: retrying cannot help).
    error: str | None = None
    error_code: str | None = None


class FirstToken(NamedTuple):
    """A request whose first generated token came out in a step (its prefill finished)."""

    request_id: str
    num_prompt_tokens: int  # len(prompt_token_ids)
    num_cached_tokens: int  # of them, served from the prefix cache (not computed)
    time: float  # time.monotonic() when the token was appended


@dataclass
class StepStats:
    """What one ``step()`` did, for the worker's metrics (``WorkerEngine.step_stats``).

    Filled at a cost of O(requests that got their first token), so that metrics need no per-step
    output of every running request (the worker runs its requests ``final_only``): TTFT and prompt
    tokens come from ``first_tokens``, generation tokens from ``num_generated_tokens``, and the
    end-to-end time from the finished outputs ``step()`` returned.
    """

    # Each request once, in the step its first token came out (of any of its ``n`` completions).
    first_tokens: list[FirstToken] = field(default_factory=list)
    num_generated_tokens: int = 0  # tokens appended this step, every completion, forced ones too


# -- embeddings ---------------------------------------------------------------------------------


@dataclass
class EmbeddingOutput:
    """One input's vector, as vLLM's ``EmbeddingOutput``."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """What ``LLM.embed`` returns per prompt, shaped as vLLM's: ``out.outputs.embedding``."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class PooledRequestOutput:
    """An embedding request's result as the embedding engine hands it to the worker daemon.

    One request of the queue may carry several inputs (an OpenAI ``input`` list); it finishes when
    every input is pooled, with one vector per input in input order. ``data`` is a CPU float32
    tensor ``[num_inputs, dim]`` (typed ``Any`` so this module stays torch-free), already pooled,
    truncated to the request's ``dimensions`` and normalised as asked.
    """

    request_id: str
    prompt_token_ids: list[list[int]]  # per input, as the engine ran them (after any truncation)
    data: Any = None  # torch.Tensor [num_inputs, dim] float32 on the CPU; None when ``error`` is set
    finished: bool = True
    error: str | None = None  # set when the engine failed this request (published as engine_error)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(ids) for ids in self.prompt_token_ids)
