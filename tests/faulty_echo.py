"""``FaultyEchoEngine``: the echo engine with the reliability tests' faults (never shipped).

In process, ``fault_hook(request_id)`` raising makes that request fail (finished with an error)
and ``step_fault_hook(request_ids)`` raising makes the whole step fail with nothing changed.
Through the CLI (``batchinfer worker --echo --echo-class faulty_echo:FaultyEchoEngine`` with
tests/ on PYTHONPATH), plain values set by ``--engine-option``: ``poison=MARKER`` makes every step
that would finish a request whose prompt holds MARKER raise, the way a poison input crashes a
batch; with ``poison_exit=true`` such a step ends the whole process instead (exit code
``POISON_EXIT_CODE``), the way a poison input that corrupts the device (a CUDA fault) kills a worker.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from batchinfer.workers.service.echo_engine import EchoEngine

POISON_EXIT_CODE = 86
ENGINE_CLASS = "faulty_echo:FaultyEchoEngine"  # --echo-class
FAULT_OPTIONS = ("poison", "poison_exit")  # --engine-option keys that need this class


class FaultyEchoEngine(EchoEngine):
    """An echo engine that fails where a test tells it to; see the module docstring."""

    def __init__(self, *args: Any, fault_hook: Callable[[str], None] | None = None,
                 step_fault_hook: Callable[[list[str]], None] | None = None, poison: str | None = None,
                 poison_exit: bool = False, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.fault_hook = fault_hook
        self.step_fault_hook = step_fault_hook
        self.poison = poison or None
        self.poison_exit = bool(poison_exit)

    def check_step(self, requests: list[tuple[str, list[int]]]) -> None:
        if self.step_fault_hook is not None:
            self.step_fault_hook([request_id for request_id, _ in requests])
        if not self.poison:
            return
        poisoned = [request_id for request_id, ids in requests
                    if self.poison in self.tokenizer.decode(ids, skip_special_tokens=False)]
        if poisoned and self.poison_exit:
            os._exit(POISON_EXIT_CODE)  # no cleanup, no flush: as abrupt as a device fault
        if poisoned:
            raise RuntimeError(f"poison request in the step: {poisoned[0]} (prompt contains {self.poison!r})")

    def check_request(self, request_id: str) -> None:
        if self.fault_hook is not None:
            self.fault_hook(request_id)
