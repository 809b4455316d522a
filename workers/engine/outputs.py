"""What the engine hands back: one ``RequestOutput`` per request, ``n`` completions each."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    # while processing it); the worker daemon publishes it as an ``engine_error`` row.
    error: str | None = None
