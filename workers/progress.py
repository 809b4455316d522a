"""Progress bars for the places a person waits: model loading, submit, wait / run, exports.

Bars go to stderr (stdout stays for job ids and ``--json`` output) and only when someone watches:
a bar is silent when its stream is not a terminal, with ``--quiet``, and with ``--json``. All
helpers return a :class:`Progress` with the same small API whether it draws or not, so callers
never branch on it. A job's progress (:class:`JobProgress`) without a terminal (CI, cron, a pipe)
is a plain line every ``interval`` seconds instead, so a pipeline's log shows the job moving.

Rates and ETAs count completed requests only (:func:`completion_rate`): failures and cancelled
rows arrive at once and would promise an end that never comes.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import IO, Any, TypeVar

from tqdm import tqdm

_P = TypeVar("_P", bound="Progress")  # `with JobProgress(...) as bar` gives a JobProgress (no Self in 3.10)
LINE_INTERVAL_S = 10.0  # JobProgress without a terminal: one line this often (--progress-every)
CLOCK: Callable[[], float] = time.monotonic  # JobProgress's default clock (tests set their own)


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


def completion_rate(first: tuple[float, int], last: tuple[float, int]) -> float | None:
    """Completed requests per second between two ``(seconds, completed)`` observations of a job;
    None before a completion was seen. Failed, cancelled and expired rows are not counted: they
    arrive all at once (a bad line fails in a millisecond) and say nothing of how fast the rest runs."""
    (t0, c0), (t1, c1) = first, last
    if c1 <= c0 or t1 <= t0:
        return None
    return (c1 - c0) / (t1 - t0)


def eta_seconds(rate: float | None, left: int | None) -> float | None:
    """Seconds until ``left`` more requests are done at ``rate``; None without a rate or a total."""
    if rate is None or left is None:
        return None
    return max(0, left) / rate


def duration_text(seconds: float | None) -> str:
    """``45s``, ``3m07s``, ``2h05m``; ``-`` for None."""
    if seconds is None:
        return "-"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class JobProgress(Progress):
    """A job's requests: done of total, failures, tokens/s, and a rate and ETA from completions
    (``wait``, ``submit --wait``, ``run``).

    ``update`` takes the job record's counters as they are polled; the total may be unknown
    (None) while the job is still being submitted. At a terminal it draws a tqdm bar; without one
    (and not ``quiet`` / ``json_output``) it writes a plain line every ``interval`` seconds of
    ``clock`` (``interval`` 0: never).
    """

    def __init__(self, job_id: str, total: int | None = None, *, interval: float = LINE_INTERVAL_S,
                 clock: Callable[[], float] | None = None, **options: Any):
        super().__init__(f"job {job_id}", total, unit=" req", **options)
        self.job_id = job_id
        stream = options.get("stream")
        self._stream = stream if stream is not None else sys.stderr
        self.lines = (not self.enabled and interval > 0
                      and not options.get("quiet") and not options.get("json_output"))
        self._interval = interval
        self._clock = clock or CLOCK
        self._start = self._clock()
        self._last_line = self._start
        self._first: tuple[float, int] | None = None  # (time, completed) of the first observation
        self._tokens: tuple[float, int] | None = None  # (time, count) of the first token observation

    def update(self, completed: int, failed: int = 0, total: int | None = None, *,
               tokens: int | None = None, tokens_per_s: float | None = None, held: str | None = None,
               eta: bool = True, done: int | None = None) -> None:
        """Counters of the job record; ``tokens`` (cumulative) or ``tokens_per_s`` for the rate shown.

        ``held`` (e.g. ``"3 held: model 'x' is not served; served: a"``) is shown instead of an ETA:
        requests waiting for a model no worker serves have none; ``eta`` False (no live worker
        serves the job's model) shows none either. ``done``: rows of any kind (``completed +
        failed`` when None), for what is left.
        """
        now = self._clock()
        if self._first is None:
            self._first = (now, completed)
        rate = completion_rate(self._first, (now, completed))
        done = completed + failed if done is None else done
        left = None if total is None else total - done
        eta_s = eta_seconds(rate, left) if eta and not held else None
        if self.lines:
            if now - self._last_line >= self._interval:
                self._last_line = now
                self._write_line(now, completed, failed, total, done, rate, eta_s, held, eta)
            return
        if not self.enabled:
            return
        assert self._bar is not None
        self._bar.bar_format = BAR_FORMAT  # done / total and elapsed; rate and ETA ours, in the fields
        self.set(done, total)
        if tokens is not None:
            if self._tokens is None:
                self._tokens = (now, tokens)
            elif now > self._tokens[0]:
                tokens_per_s = (tokens - self._tokens[1]) / (now - self._tokens[0])
        self.note(failed=failed or None, req_s=None if rate is None else f"{rate:.2f}",
                  tok_s=None if tokens_per_s is None else f"{tokens_per_s:,.0f}",
                  left=None if eta_s is None else duration_text(eta_s), held=held)

    def _write_line(self, now: float, completed: int, failed: int, total: int | None, done: int,
                    rate: float | None, eta_s: float | None, held: str | None, eta: bool) -> None:
        """``job J: 120/500 done (118 completed, 2 failed), 3.10 req/s, 2m03s left, 40s elapsed``."""
        of = total if total is not None else "?"
        parts = [f"{done}/{of} done ({completed} completed, {failed} failed)",
                 "- req/s" if rate is None else f"{rate:.2f} req/s"]
        if held:
            parts.append(held)
        elif not eta:
            parts.append("no ETA: no live worker serves the job's model")
        else:
            parts.append(f"{duration_text(eta_s)} left")
        parts.append(f"{duration_text(now - self._start)} elapsed")
        self._stream.write(f"job {self.job_id}: {', '.join(parts)}\n")
        self._stream.flush()


# tqdm's bar without its own rate and remaining time (they count failures): done / total, elapsed,
# then the fields (failed, req_s and left from completions, tok_s, held)
BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"


__all__ = ["JobProgress", "Progress", "bytes_progress", "completion_rate", "duration_text", "eta_seconds",
           "lines_progress", "rows_progress", "show_progress"]
