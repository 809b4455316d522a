"""Progress bars draw only for a person at a terminal: never when piped, with --quiet or --json."""

from __future__ import annotations

import io

import pytest

from batchinfer.workers.progress import (
    JobProgress,
    Progress,
    bytes_progress,
    lines_progress,
    rows_progress,
    show_progress,
)


class FakeTerminal(io.StringIO):
    """A stream that says it is a terminal, to see what a person would see."""

    def isatty(self) -> bool:
        return True


def exercise_every_helper(stream: io.StringIO, **options) -> None:
    with bytes_progress("loading weights", 4096, stream=stream, **options) as bar:
        bar.advance(1024)
        bar.set(4096)
    with lines_progress("submitting", stream=stream, **options) as bar:
        for _ in range(7):
            bar.advance()
        bar.note(rejected=2)
    with rows_progress("exporting", 10, stream=stream, **options) as bar:
        bar.set(10)
    with JobProgress("job-1", 10, stream=stream, **options) as bar:
        bar.update(3, 1, 10, tokens_per_s=250.0)
        bar.update(9, 1, tokens=500)


def test_nothing_is_written_when_the_stream_is_not_a_terminal():
    stream = io.StringIO()
    exercise_every_helper(stream)
    assert stream.getvalue() == ""


@pytest.mark.parametrize("flag", ["quiet", "json_output"])
def test_quiet_and_json_silence_a_terminal(flag):
    stream = FakeTerminal()
    exercise_every_helper(stream, **{flag: True})
    assert stream.getvalue() == ""


def test_a_terminal_sees_counts_failures_and_rates():
    stream = FakeTerminal()
    exercise_every_helper(stream)
    text = stream.getvalue()
    assert "loading weights" in text and "4.10k/4.10k" in text
    assert "submitting: 7 lines" in text and "rejected=2" in text
    assert "exporting" in text and "10/10" in text
    assert "job job-1" in text and "4/10" in text and "failed=1" in text and "tok_s=250" in text
    assert "10/10" in text.rsplit("job job-1", 1)[1]


def test_total_can_arrive_later():
    stream = FakeTerminal()
    with JobProgress("j", None, stream=stream) as bar:
        bar.update(2, 0)
        bar.update(5, 0, total=8)
    assert "5/8" in stream.getvalue()


def test_disabled_progress_accepts_every_call():
    bar = Progress("x", 3, stream=io.StringIO())
    assert not bar.enabled
    bar.advance(2)
    bar.set(3, 4)
    bar.note(a=1)
    bar.close()


def test_show_progress_on_a_closed_stream_is_false():
    stream = FakeTerminal()
    assert show_progress(stream=stream)
    stream.close()

    class Closed(io.StringIO):
        def isatty(self) -> bool:
            raise ValueError("I/O operation on closed file")

    assert not show_progress(stream=Closed())
