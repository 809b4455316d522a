"""Start-up errors of the daemons: one line that says what is wrong and what to do.

A daemon (scheduler, worker, exporter) raises :class:`StartupError` for a reason its operator
fixes before it serves anything: a model folder without config.json, a device this machine does
not have, a metrics port in use, a worker name another live worker holds. The command line
prints the message as one line and exits with ``EXIT_STARTUP`` (docs/cli.md); the traceback is
logged at DEBUG only.
"""

from __future__ import annotations


class StartupError(Exception):
    """A daemon cannot start; ``str(error)`` names what is wrong and what to do."""


class PortInUseError(StartupError, OSError):
    """The metrics port cannot be listened on (an ``OSError`` too, as it was before)."""


__all__ = ["PortInUseError", "StartupError"]
