"""`batchinfer top` renders workers, jobs in progress and queue depths: known snapshots and real Redis."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from batchinfer.cli.top import Snapshot, render_to_text, run_top, snapshot_from_redis, snapshot_to_dict
from batchinfer.keys import SCHEDULER_GROUP, WORKERS_GROUP, Keys
from batchinfer.ops.metrics import WorkerMetrics
from batchinfer.protocol.entries import IntakeEntry
from batchinfer.protocol.rows import ResultRow, now_ms
from batchinfer.store.jobstore import JobStore
from batchinfer.store.publish import Publisher
from batchinfer.store.queue_state import JobView, QueueState, StreamState, WorkerView
from batchinfer.store.registry import Registry

NOW = 1_750_000_000_000


def known_snapshot() -> Snapshot:
    workers = [
        WorkerView("gpu-a", "llama-8b", NOW - 2_000, device="cuda:0", running=96, waiting=12,
                   max_num_seqs=128, kv_usage=0.83, tokens_per_s=4321.5),
        WorkerView("gpu-b", "llama-8b", NOW - 60_000, device="cuda:1"),  # silent for a minute
    ]
    jobs = [JobView("job-big", "in_progress", "llama-8b", submitted=1000, total=1000, completed=390,
                    failed=10, created_at=NOW - 300_000, in_progress_at=NOW - 200_000),
            JobView("job-new", "validating", "llama-8b", submitted=250, total=None, completed=0, failed=0,
                    created_at=NOW - 1_000)]
    queues = QueueState(intake=StreamState(length=900, undelivered=500, unacked=20,
                                           oldest_undelivered_ms=NOW - 90_000, group_exists=True),
                        batches={"llama-8b": StreamState(length=5, undelivered=3, unacked=2,
                                                         oldest_undelivered_ms=NOW - 4_000)},
                        deadletter=7)
    return Snapshot(taken_at=NOW, workers=workers, jobs=jobs, queues=queues, where="redis://cache:6379/0")


def row_of(text: str, first_cell: str) -> str:
    return next(line for line in text.splitlines() if f" {first_cell} " in line)


def test_render_a_known_snapshot():
    text = render_to_text(known_snapshot(), width=160)
    assert "batchinfer top  redis://cache:6379/0" in text
    assert "2 worker(s), 2 job(s) in progress" in text
    gpu_a = row_of(text, "gpu-a")
    for cell in ("llama-8b", "cuda:0", "96/128 (75%)", "12", "4,321.5", "83%", "2s ago"):
        assert cell in gpu_a, cell
    assert "1m00s ago" in row_of(text, "gpu-b")
    big = row_of(text, "job-big")
    # 400 done in the 200 s since it started: 2.0 req/s, 600 left: 5 minutes
    for cell in ("in_progress", "400/1000", "10", "2.0", "5m00s"):
        assert cell in big, cell
    assert "0/250+" in row_of(text, "job-new")  # total unknown while still submitting
    assert "500" in row_of(text, "intake (requests)") and "1m30s" in row_of(text, "intake (requests)")
    batches = row_of(text, "batches: llama-8b")
    assert " 3 " in batches and " 2 " in batches and "4s" in batches
    assert "7" in row_of(text, "dead letters")


def test_render_an_empty_deployment():
    empty = Snapshot(taken_at=NOW, workers=[], jobs=[], queues=QueueState(StreamState(), {}, 0))
    text = render_to_text(empty)
    assert "no live workers" in text and "no jobs in progress" in text


def seed(r, keys: Keys) -> str:
    """A worker heartbeating with its metrics, a job half done, and requests waiting in intake."""
    metrics = WorkerMetrics("tiny", device="cpu")
    metrics.set_engine_state(running=3, waiting=1, kv_usage=0.5)
    info = {"model": "tiny", "capacity": {"max_num_seqs": 4, "max_model_len": 512,
                                          "max_num_batched_tokens": 256, "kv_tokens": 4096},
            **metrics.heartbeat_fields()}
    Registry(r, keys).heartbeat_worker("worker-1", info, ttl=60)
    r.sadd(keys.models, "tiny")
    job = JobStore(r, keys).create(model="tiny")
    publisher = Publisher(r, keys)
    publisher.finish_submission(job.id, 4)
    for idx in range(2):
        publisher.publish(ResultRow(job_id=job.id, request_id=f"{job.id}:{idx}", idx=idx, status="completed",
                                    model="tiny"))
    r.xgroup_create(keys.requests, SCHEDULER_GROUP, id="0", mkstream=True)
    r.xgroup_create(keys.batches("tiny"), WORKERS_GROUP, id="0", mkstream=True)
    for idx in range(2, 4):
        r.xadd(keys.requests, IntakeEntry(json.dumps({"prompt": "hi"}), job.id, idx).to_fields())
    r.xadd(keys.batches("tiny"), {"v": "1", "requests": "[]"})
    return job.id


def test_snapshot_from_real_redis_state(redis_server):
    r, keys = redis_server.client(), Keys("{top}")
    job_id = seed(r, keys)
    snap = snapshot_from_redis(r, keys, where="test")
    (worker,) = snap.workers
    assert (worker.name, worker.model, worker.device) == ("worker-1", "tiny", "cpu")
    assert (worker.running, worker.max_num_seqs, worker.kv_usage, worker.load) == (3, 4, 0.5, 0.75)
    (job,) = snap.jobs
    assert (job.id, job.status, job.done, job.total) == (job_id, "in_progress", 2, 4)
    assert snap.queues.intake.undelivered == 2 and snap.queues.batches["tiny"].undelivered == 1
    text = render_to_text(snap, width=160)
    assert "3/4 (75%)" in row_of(text, "worker-1") and "2/4" in row_of(text, job_id)


def test_run_top_draws_frames_and_returns(redis_server):
    r, keys = redis_server.client(), Keys("{live}")
    seed(r, keys)
    out = io.StringIO()
    console = Console(file=out, width=140, force_terminal=False, color_system=None)
    assert run_top(r, keys, refresh=0.01, console=console, frames=2) == 0
    assert "worker-1" in out.getvalue() and "jobs in progress" in out.getvalue()


def test_run_top_keeps_going_when_redis_is_gone(redis_server):
    r, keys = redis_server.client(), Keys("{gone}")
    redis_server.stop(kill=True)
    out = io.StringIO()
    console = Console(file=out, width=140, force_terminal=False, color_system=None)
    assert run_top(r, keys, refresh=0.01, console=console, frames=2) == 0
    assert "cannot read Redis" in out.getvalue()


def test_snapshot_as_json_has_rates_and_etas():
    data = json.loads(json.dumps(snapshot_to_dict(known_snapshot())))
    big = next(j for j in data["jobs"] if j["id"] == "job-big")
    assert (big["done"], big["rate"], big["eta_seconds"]) == (400, 2.0, 300.0)
    assert data["workers"][0]["load"] == 0.75 and data["workers"][1]["load"] is None
    assert data["queues"]["intake"]["lag_seconds"] == 90.0 and data["queues"]["deadletter"] == 7


def test_no_eta_while_no_live_worker_serves_the_jobs_model(redis_server):
    r, keys = redis_server.client(), Keys("{eta}")
    job_id = seed(r, keys)
    r.hset(keys.job(job_id), "in_progress_at", now_ms() - 10_000)  # 2 answered in 10 s: 0.2 req/s
    [job] = snapshot_to_dict(snapshot_from_redis(r, keys))["jobs"]
    assert job["served"] is True and job["eta_seconds"] == pytest.approx(10.0, rel=0.2)
    Registry(r, keys).unregister_worker("worker-1")  # its only worker is gone
    snap = snapshot_from_redis(r, keys)
    [job] = snapshot_to_dict(snap)["jobs"]
    assert job["served"] is False and job["eta_seconds"] is None and job["rate"] is not None
    assert "no worker" in row_of(render_to_text(snap, width=160), job_id)
