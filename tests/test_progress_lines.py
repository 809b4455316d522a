"""Issue 28, item 4: progress a pipeline can read.

Without a terminal a job's progress is a plain line every ``interval`` seconds; rate and ETA count
completed requests only (instant failures promised "5.88 req/s, 6 s left" for a 2m18s job); no ETA
while no live worker serves the job's model; requests held while ``run``'s own worker loads say so.
Clocks are injected: nothing here sleeps or measures time.
"""

from __future__ import annotations

import io
import uuid

import pytest
from cli_helpers import invoke, prompts

from batchinfer.cli import context as cli_context
from batchinfer.cli import render
from batchinfer.client.client import Client
from batchinfer.config import Settings
from batchinfer.workers import progress
from batchinfer.workers.progress import JobProgress, completion_rate, duration_text, eta_seconds


class FakeClock:
    """Seconds that move only when the test says so."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_completion_rate_counts_completions_only():
    assert completion_rate((0.0, 0), (10.0, 20)) == 2.0
    assert completion_rate((5.0, 10), (15.0, 30)) == 2.0  # from the first observation, not from zero
    assert completion_rate((0.0, 0), (10.0, 0)) is None  # only failures so far: no rate at all
    assert completion_rate((0.0, 3), (0.0, 3)) is None
    assert eta_seconds(2.0, 100) == 50.0 and eta_seconds(None, 100) is None and eta_seconds(2.0, None) is None
    assert [duration_text(s) for s in (None, 45, 187, 7500)] == ["-", "45s", "3m07s", "2h05m"]


def test_lines_come_at_the_interval_without_a_terminal():
    clock, stream = FakeClock(), io.StringIO()
    with JobProgress("j1", stream=stream, interval=10, clock=clock) as bar:
        assert bar.lines and not bar.enabled
        bar.update(0, 0, 1000)
        clock.now += 5
        bar.update(5, 0, 1000)
        assert stream.getvalue() == ""  # not yet 10 s
        clock.now += 5
        bar.update(10, 0, 1000)
        clock.now += 5
        bar.update(15, 0, 1000)
        clock.now += 5
        bar.update(20, 0, 1000)
    lines = stream.getvalue().splitlines()
    assert lines == ["job j1: 10/1000 done (10 completed, 0 failed), 1.00 req/s, 16m30s left, 10s elapsed",
                     "job j1: 20/1000 done (20 completed, 0 failed), 1.00 req/s, 16m20s left, 20s elapsed"]


def test_instant_failures_do_not_make_a_rate():
    """300 bad lines fail in the first second: the rate and ETA wait for completions."""
    clock, stream = FakeClock(), io.StringIO()
    bar = JobProgress("j2", stream=stream, interval=1, clock=clock)
    bar.update(0, 0, 1000)
    clock.now += 1
    bar.update(0, 300, 1000)
    clock.now += 99
    bar.update(50, 300, 1000)
    first, second = stream.getvalue().splitlines()
    assert first == "job j2: 300/1000 done (0 completed, 300 failed), - req/s, - left, 1s elapsed"
    # 50 completions in 100 s: 0.5 req/s, 650 left -> 1300 s (counting the failures: 3.5 req/s, 3m06s)
    assert second == ("job j2: 350/1000 done (50 completed, 300 failed), 0.50 req/s, 21m40s left, "
                      "1m40s elapsed")


def test_no_eta_without_a_serving_worker_and_held_text_instead():
    clock, stream = FakeClock(), io.StringIO()
    bar = JobProgress("j3", stream=stream, interval=1, clock=clock)
    bar.update(0, 0, 10)
    clock.now += 2
    bar.update(4, 0, 10, eta=False)
    clock.now += 2
    bar.update(4, 0, 10, held="6 held: a worker is loading model 'demo'")
    first, second = stream.getvalue().splitlines()
    assert "no ETA: no live worker serves the job's model" in first and " left" not in first
    assert "6 held: a worker is loading model 'demo'" in second and " left" not in second


@pytest.mark.parametrize("options", [{"quiet": True}, {"json_output": True}, {"interval": 0}])
def test_quiet_json_and_interval_zero_print_no_lines(options):
    clock, stream = FakeClock(), io.StringIO()
    bar = JobProgress("j", stream=stream, clock=clock, **options)
    bar.update(0, 0, 10)
    clock.now += 100
    bar.update(5, 0, 10)
    assert stream.getvalue() == "" and not bar.lines


def test_the_terminal_bar_shows_the_completion_rate_and_no_eta_without_a_worker():
    clock, stream = FakeClock(), FakeTerminal()
    with JobProgress("j4", stream=stream, clock=clock) as bar:
        bar.update(0, 0, 100)
        clock.now += 10
        bar.update(20, 30, 100)  # 30 instant failures: 2 req/s from 20 completions in 10 s
    text = stream.getvalue()
    assert "req_s=2.00" in text and "left=25s" in text and "failed=30" in text
    stream = FakeTerminal()
    with JobProgress("j5", stream=stream, clock=clock) as bar:
        bar.update(0, 0, 100)
        clock.now += 10
        bar.update(20, 0, 100, eta=False)
    assert "req_s=2.00" in stream.getvalue() and "left=" not in stream.getvalue()


def test_a_loading_worker_is_said_instead_of_not_served():
    assert render.held_text(7, "demo", [], loading=True) == "7 held: a worker is loading model 'demo'"
    assert render.held_text(7, "demo", []) == ("7 held: model 'demo' is not served; "
                                               "served: none (no live worker)")
    assert "is served now" in render.held_text(7, "demo", ["demo"], loading=True)


def test_wait_prints_lines_without_a_terminal(redis_session, tmp_path, monkeypatch):
    """`wait` under CliRunner (not a terminal): a line at the interval, no ETA with no worker."""
    prefix = f"{{p{uuid.uuid4().hex[:8]}}}"
    with Client(settings=Settings(redis_url=redis_session.url, prefix=prefix)) as client:
        job = client.submit(str(prompts(tmp_path)), model="nobody-serves-me")
    clock = FakeClock()

    def ticking() -> float:  # every reading is 10 s later: each poll is past the interval
        clock.now += 10
        return clock.now

    monkeypatch.setattr(progress, "CLOCK", ticking)
    result = invoke("--redis-url", redis_session.url, "--prefix", prefix, "wait", job, "--timeout", "0",
                    code=cli_context.EXIT_TIMEOUT)
    line = next(x for x in result.output.splitlines() if x.startswith(f"job {job}: "))
    assert "/3 done (0 completed, 0 failed), - req/s" in line, result.output
    assert line.endswith("no ETA: no live worker serves the job's model, 10s elapsed"), line
    quiet = invoke("--redis-url", redis_session.url, "--prefix", prefix, "wait", job, "--timeout", "0",
                   "--progress-every", "0", code=cli_context.EXIT_TIMEOUT)
    assert f"job {job}: " not in quiet.output
