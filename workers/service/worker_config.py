"""``WorkerConfig``: how a worker daemon presents itself (its name and served model names) and
paces its loop.

Every error is a ``ValueError`` whose message starts with the field's name. No torch: an echo
worker builds one without loading it.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Any

from batchinfer.workers.tools import TOOL_PARSERS


def _served_name(what: str, value: Any) -> str:
    if not isinstance(value, str) or not value or any(c.isspace() for c in value):
        raise ValueError(f"{what} must be a non-empty name without spaces, got {value!r}")
    return value


@dataclass
class WorkerConfig:
    """How one worker daemon presents itself (its name and the model names it serves) and paces
    its loop; built once (``serve.py``, or a test) and handed to ``WorkerDaemon``.

    ``served_model_names`` are vLLM's ``--served-model-name``: the first is the canonical name
    (the worker registers under it and pulls ``{p}:batches:<canonical>``), the others are aliases
    a request's ``model`` may name as well. Empty: ``[model_name]`` when that is given (the single
    ``--model-name`` of earlier versions), else ``[model]``, the model folder's (the engine's)
    name. ``name`` defaults to ``<host>-<canonical>-<device>-<pid>``: unique per process on a host,
    and stable across restarts of a container (same hostname, same pid 1).

    The loop's pacing: a pull with nothing held or running waits ``block_ms`` for a batch; the
    publisher thread reads the cancelled jobs every ``cancel_poll_seconds``; ``max_failed_steps``
    engine steps failing in a row end the daemon (exit 3); the keeper lets the leases lapse when
    the loop is silent for ``stall_seconds`` (None: ten leases).

    ``tool_call_parser`` (vLLM's ``--tool-call-parser``): the format in which the model writes the
    tool calls of a ``tool_choice: "auto"`` request, one of ``TOOL_PARSERS``; None: the one the
    model's chat template makes unambiguous, if any (``WorkerDaemon``).
    """

    model: str  # the engine's model name: the model folder's name (``echo`` for a bare echo engine)
    served_model_names: list[str] = field(default_factory=list)
    model_name: str | None = None
    name: str | None = None
    device: str = "cpu"
    block_ms: int = 1000
    cancel_poll_seconds: float = 0.5
    max_failed_steps: int = 32
    stall_seconds: float | None = None
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.served_model_names, str):  # one name passed bare: not a list of letters
            self.served_model_names = [self.served_model_names]
        names = [_served_name("served_model_names", n) for n in self.served_model_names]
        if self.model_name is not None:
            _served_name("model_name", self.model_name)
            if names and names[0] != self.model_name:
                raise ValueError(f"model_name {self.model_name!r} and served_model_names {names} disagree: "
                                 "give the names once, as served_model_names (the first is canonical)")
        if not names:
            names = [self.model_name or _served_name("model", self.model)]
        self.served_model_names = list(dict.fromkeys(names))  # a name given twice is served once
        if self.name is None:
            device = self.device.replace(":", "").replace(",", "+")  # cuda0+cuda1 under TP
            self.name = f"{socket.gethostname()}-{self.canonical}-{device}-{os.getpid()}"
        _served_name("name", self.name)
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_PARSERS)}, "
                             f"got {self.tool_call_parser!r}")

    @property
    def canonical(self) -> str:
        """The name the worker registers its model under."""
        return self.served_model_names[0]

    @property
    def aliases(self) -> list[str]:
        """The other served names: requests naming them go to the canonical model's batches."""
        return self.served_model_names[1:]
