"""Progress bars for the places a person waits: model loading, submit, wait / run, exports.

Bars go to stderr (stdout stays for job ids and ``--json`` output) and only when someone watches:
a bar is silent when its stream is not a terminal, with ``--quiet``, and with ``--json``. All
helpers return a :class:`Progress` with the same small API whether it draws or not, so callers
never branch on it.
"""

from __future__ import annotations

import sys
import time
from typing import IO, Any, TypeVar

from tqdm import tqdm

_P = TypeVar("_P", bound="Progress")  # `with JobProgress(...) as bar` gives a JobProgress (no Self in 3.10)


def show_progress(quiet: bool = False, json_output: bool = False, stream: IO[str] | None = None) -> bool:
    """Whether to draw: not ``quiet``, not ``json_output``, and ``stream`` (stderr) is a terminal."""
    if quiet or json_output:
        return False
    stream = stream if stream is not None else sys.stderr
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


class Progress:
    """One bar: ``advance`` by a step, ``set`` an absolute count, ``note`` extra fields; a context manager.

    ``total=None`` counts without a bar (lines of a file being read). When disabled every method
    does nothing and nothing is written.
    """

    def __init__(self, description: str, total: float | None = None, *, unit: str = "it",
                 unit_scale: bool = False, quiet: bool = False, json_output: bool = False,
                 stream: IO[str] | None = None, leave: bool = True):
        stream = stream if stream is not None else sys.stderr
        self.enabled = show_progress(quiet, json_output, stream)
        self._bar: tqdm | None = None
        if self.enabled:
            self._bar = tqdm(total=total, desc=description, unit=unit, unit_scale=unit_scale, file=stream,
                             leave=leave, dynamic_ncols=True, smoothing=0.1)

    def advance(self, n: float = 1) -> None:
        if self._bar is not None and n:
            self._bar.update(n)

    def set(self, completed: float, total: float | None = None) -> None:
        """Show ``completed`` of ``total`` (``total`` unchanged when None)."""
        if self._bar is None:
            return
        if total is not None and total != self._bar.total:
            self._bar.total = total
        self._bar.update(completed - self._bar.n)  # keeps tqdm's rate and ETA estimates

    def note(self, **fields: Any) -> None:
        """Extra fields after the bar, e.g. ``note(rejected=3)``; None values are left out."""
        if self._bar is not None:
            self._bar.set_postfix({k: v for k, v in fields.items() if v is not None}, refresh=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self: _P) -> _P:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def bytes_progress(description: str, total_bytes: int, **options: Any) -> Progress:
    """Bytes with units (``loading weights: 1.2GB/14.9GB``): model loading, downloads."""
    return Progress(description, total_bytes, unit="B", unit_scale=True, **options)


def lines_progress(description: str = "reading", **options: Any) -> Progress:
    """Lines of an input file as they are read (no total); ``note(rejected=n)`` for bad lines."""
    return Progress(description, None, unit=" lines", **options)


def rows_progress(description: str = "exporting", total: int | None = None, **options: Any) -> Progress:
    """Rows written by an export."""
    return Progress(description, total, unit=" rows", **options)


class JobProgress(Progress):
    """A job's requests: done of total, failures, tokens/s and tqdm's rate and ETA (``wait``, ``run``).

    ``update`` takes the job record's counters as they are polled; the total may be unknown
    (None) while the job is still being submitted.
    """

    def __init__(self, job_id: str, total: int | None = None, **options: Any):
        super().__init__(f"job {job_id}", total, unit=" req", **options)
        self._tokens: tuple[float, int] | None = None  # (time, count) of the first token observation

    def update(self, completed: int, failed: int = 0, total: int | None = None, *,
               tokens: int | None = None, tokens_per_s: float | None = None, held: str | None = None) -> None:
        """Counters of the job record; ``tokens`` (cumulative) or ``tokens_per_s`` for the rate shown.

        ``held`` (e.g. ``"3 held: model 'x' is not served; served: a"``) is shown instead of an ETA:
        requests waiting for a model no worker serves have none.
        """
        if not self.enabled:
            return
        assert self._bar is not None
        self._bar.bar_format = HELD_FORMAT if held else None  # tqdm's default, with its ETA
        self.set(completed + failed, total)
        if tokens is not None:
            now = time.monotonic()
            if self._tokens is None:
                self._tokens = (now, tokens)
            elif now > self._tokens[0]:
                tokens_per_s = (tokens - self._tokens[1]) / (now - self._tokens[0])
        self.note(failed=failed or None,
                  tok_s=None if tokens_per_s is None else f"{tokens_per_s:,.0f}", held=held)


# tqdm's bar without the remaining time and rate: done / total, elapsed, then the fields (held ...)
HELD_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"


__all__ = ["JobProgress", "Progress", "bytes_progress", "lines_progress", "rows_progress", "show_progress"]
