"""What the engine hands back: one ``RequestOutput`` per request, ``n`` completions each."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One of a request's ``n`` completions."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    # One dict per generated token when logprobs were asked for: token id -> logprob,
    # holding the sampled token and the top-k tokens.
    logprobs: list[dict[int, float]] | None = None

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
