"""`batchinfer top` is readable from 80 columns up: full job ids, every header, no "…" (rich's
width rendering; docs/operations.md has the tmux check done by hand). ETAs only when bounded."""

from __future__ import annotations

import dataclasses

import pytest
from test_top import NOW, known_snapshot

from batchinfer.cli.top import Snapshot, render_to_text, serving
from batchinfer.store.queue_state import JobView

JOB_A = "job_0193a3b4c5d6_a1b2c3d4e5f6"  # the length new_job_id() makes
JOB_B = "job_0193a3b4c5d7_ffffffffffff"


def realistic() -> Snapshot:
    snap = known_snapshot()
    snap.jobs = [dataclasses.replace(snap.jobs[0], id=JOB_A, model="SmolLM2-135M-Instruct"),
                 dataclasses.replace(snap.jobs[1], id=JOB_B, held=3)]
    snap.held, snap.served = {"SmolLM2": 3}, ["hf", "qwen"]
    snap.workers = [dataclasses.replace(snap.workers[0], model="SmolLM2-135M-Instruct"), snap.workers[1]]
    return snap


@pytest.mark.parametrize("width", [80, 100, 160])
def test_every_column_and_id_fits(width):
    text = render_to_text(realistic(), width=width)
    assert "…" not in text
    assert all(len(line) <= width for line in text.splitlines())
    for job in (JOB_A, JOB_B):
        assert job in text  # on one line, never cut
    for header in ("worker", "model", "device", "load", "tok", "KV", "status", "done", "fail", "req/s",
                   "ETA", "queue", "waiting"):
        assert header in text, (width, header)
    assert "3 held: model 'SmolLM2' is not served; served: hf, qwen" in text
    row = next(line for line in text.splitlines() if JOB_A in line)
    assert "400/1000" in row and "2.0" in row and "5m00s" in row
    assert "3 held" in next(line for line in text.splitlines() if JOB_B in line)


def test_no_eta_without_a_bound_and_no_rate_spike_after_a_cancel():
    running = JobView("j", "in_progress", "m", submitted=100, total=100, completed=10, failed=0,
                      created_at=NOW - 20_000, in_progress_at=NOW - 10_000)
    assert running.rate(NOW) == 1.0 and running.eta_seconds(NOW) == 90.0
    held = dataclasses.replace(running, held=5)
    assert held.eta_seconds(NOW) is None  # requests waiting for an unserved model: no ETA
    cancelled = dataclasses.replace(running, status="cancelling", cancelled=90)
    assert cancelled.done == 100
    assert cancelled.rate(NOW) == 1.0  # the 90 cancelled rows are not answers: no spike
    assert cancelled.eta_seconds(NOW) is None
    submitting = dataclasses.replace(running, total=None)
    assert submitting.eta_seconds(NOW) is None


def test_no_eta_while_no_live_worker_serves_the_model():
    # issue 28: a job nothing could run showed "4m27s" left
    snap = realistic()
    running = snap.jobs[0]
    assert serving(snap, running) and running.eta_seconds(NOW, served=True) == 300.0
    assert running.eta_seconds(NOW, served=False) is None
    snap.workers, snap.served = [], []  # no live worker at all
    assert not serving(snap, running)
    assert serving(dataclasses.replace(snap, served=["SmolLM2-135M-Instruct"]), running)  # an alias of one
    assert not serving(snap, dataclasses.replace(running, model=""))  # a job naming no model: any worker
    for width in (80, 160):
        text = render_to_text(snap, width=width)
        row = next(line for line in text.splitlines() if JOB_A in line)
        assert "no worker" in row and "5m00s" not in row and "2.0" in row  # the rate so far stays
        assert all(len(line) <= width for line in text.splitlines())
