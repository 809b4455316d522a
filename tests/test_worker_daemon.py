"""The worker daemon against a real redis-server, with the echo engine (and once with the tiny model)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from daemons import ThreadedWorker, wait_until, worker_daemon
from faulty_echo import FaultyEchoEngine

from batchinfer.config import Settings
from batchinfer.keys import WORKERS_GROUP, Keys
from batchinfer.protocol.rows import BatchRequest, ResultRow
from batchinfer.store.jobstore import JobStore
from batchinfer.store.publish import Publisher
from batchinfer.store.registry import Registry
from batchinfer.workers.service.echo_engine import EchoEngine

PREFIX = "{w}"
KEYS = Keys(PREFIX)
ROOT = Path(__file__).resolve().parents[1]


def _settings(**kw) -> Settings:
    return Settings(prefix=PREFIX, heartbeat_seconds=kw.pop("heartbeat_seconds", 0.3), **kw)


def _request(job: str, idx: int, prompt: list[int], model: str = "echo", **params) -> BatchRequest:
    return BatchRequest(request_id=f"{job}:{idx}", job_id=job, idx=idx, prompt_token_ids=prompt,
                        sampling_params={"max_tokens": 4, "temperature": 0.0, **params}, model=model,
                        line=idx + 1, custom_id=f"c{idx}", created_at=1)


def _dispatch(r, requests: list[BatchRequest], model: str = "echo", solo: bool = False) -> str:
    """What the scheduler does: one batch entry on the model's stream."""
    if not r.exists(KEYS.batches(model)):
        r.xgroup_create(KEYS.batches(model), WORKERS_GROUP, id="0", mkstream=True)
    fields = {"v": "1", "requests": json.dumps([q.to_dict() for q in requests])}
    entry = r.xadd(KEYS.batches(model), {**fields, "solo": "1"} if solo else fields)
    return entry.decode()


def _job(r, job: str, n: int, per_batch: int = 4, total: bool = True, **params) -> list[BatchRequest]:
    JobStore(r, KEYS).create(job, model="echo")
    reqs = [_request(job, i, [10 + i, 20, 30, 40, 50], **params) for i in range(n)]
    for start in range(0, n, per_batch):
        _dispatch(r, reqs[start:start + per_batch])
    if total:
        Publisher(r, KEYS).finish_submission(job, n)
    return reqs


def _rows(r, job: str) -> list[dict]:
    return [json.loads(f[b"row"]) for _, f in r.xrange(KEYS.results(job))]




def Running(r, engine, name="w1", settings=None, **kw) -> ThreadedWorker:  # noqa: N802 - reads as a class
    """A worker daemon serving in a thread; ``stop()`` drains it and returns its exit code."""
    return ThreadedWorker(worker_daemon(r, settings or _settings(), engine, name, **kw))


def test_each_request_published_once_batches_acked_and_export_enqueued(redis_server):
    from rq import Queue

    r = redis_server.client()
    _job(r, "j1", 10, per_batch=3)
    worker = Running(r, EchoEngine(requests_per_step=2, max_num_seqs=4))
    wait_until(lambda: len(_rows(r, "j1")) == 10, what="10 rows")
    wait_until(lambda: r.hget(KEYS.job("j1"), "status") == b"finalizing")
    rows = _rows(r, "j1")
    assert sorted(x["idx"] for x in rows) == list(range(10))
    row = next(x for x in rows if x["idx"] == 3)
    assert row["status"] == "completed" and row["worker"] == "w1" and row["custom_id"] == "c3"
    assert row["output_token_ids"] == [13, 20, 30, 40] and row["finish_reason"] == "length"
    assert row["prompt_tokens"] == 5 and row["completion_tokens"] == 4
    assert row["created_at"] == 1 and row["started_at"] <= row["finished_at"]
    assert row["sampling_params"]["max_tokens"] == 4 and len(row["outputs"]) == 1
    wait_until(lambda: r.xlen(KEYS.batches("echo")) == 0, what="batches acked and deleted")
    assert r.xpending(KEYS.batches("echo"), WORKERS_GROUP)["pending"] == 0
    wait_until(lambda: Queue("batchinfer", connection=r).count == 1, what="the export this worker made due")
    model = Registry(r, KEYS).get_model("echo")
    assert model.max_num_seqs == 4 and b"chat_template" in model.files["tokenizer_config.json"]
    # the heartbeat after the last flush reports all 10 rows this worker sent
    live = wait_until(lambda: [w for w in Registry(r, KEYS).live_workers("echo")
                               if w.info["requests_done"] == 10],
                      what="a heartbeat with requests_done == 10")
    assert [w.name for w in live] == ["w1"] and "tokens_per_s" in live[0].info
    assert worker.stop() == 0
    assert Registry(r, KEYS).live_workers() == []  # a clean stop unregisters


def test_redelivered_batch_runs_only_unpublished_requests(redis_server):
    r = redis_server.client()
    reqs = _job(r, "j2", 4, per_batch=4)
    pub = Publisher(r, KEYS)
    for q in reqs[:2]:  # a crashed worker published these two before dying
        pub.publish(ResultRow.error("engine_error", "earlier run", request=q, worker="dead"))
    # ... and the batch was delivered to it: "w1" restarts under the same name and finds it pending.
    r.xreadgroup(WORKERS_GROUP, "w1", {KEYS.batches("echo"): ">"}, count=1)
    seen: list[str] = []
    worker = Running(r, FaultyEchoEngine(fault_hook=seen.append))
    wait_until(lambda: len(_rows(r, "j2")) == 4)
    assert worker.stop() == 0
    assert sorted(seen) == ["j2:2", "j2:3"]
    assert {x["idx"]: x["worker"] for x in _rows(r, "j2")} == {0: "dead", 1: "dead", 2: "w1", 3: "w1"}
    assert r.xlen(KEYS.batches("echo")) == 0


def test_request_in_two_batches_runs_once_and_completes_both(redis_server):
    r = redis_server.client()
    JobStore(r, KEYS).create("j3", model="echo")
    q = [_request("j3", i, [5, 6, 7]) for i in range(3)]
    _dispatch(r, q[:2])
    _dispatch(r, q[1:])  # a re-dispatch overlapping the first batch
    seen: list[str] = []
    worker = Running(r, FaultyEchoEngine(fault_hook=seen.append, step_delay=0.05, requests_per_step=1))
    wait_until(lambda: len(_rows(r, "j3")) == 3 and r.xlen(KEYS.batches("echo")) == 0)
    assert worker.stop() == 0
    assert sorted(seen) == ["j3:0", "j3:1", "j3:2"]


def test_cancellation_aborts_running_and_waiting_requests(redis_server):
    r = redis_server.client()
    _job(r, "j4", 24, per_batch=8)
    engine = EchoEngine(requests_per_step=1, step_delay=0.05, max_num_seqs=4)
    worker = Running(r, engine, cancel_poll_seconds=0.05)
    wait_until(lambda: len(_rows(r, "j4")) >= 2)
    JobStore(r, KEYS).cancel("j4")
    wait_until(lambda: len(_rows(r, "j4")) == 24)
    assert worker.stop() == 0
    rows = _rows(r, "j4")
    statuses = [x["status"] for x in rows]
    assert sorted(x["idx"] for x in rows) == list(range(24))
    assert statuses.count("completed") >= 2 and statuses.count("cancelled") >= 8
    cancelled = next(x for x in rows if x["status"] == "cancelled")
    assert cancelled["error_code"] == "cancelled" and cancelled["worker"] == "w1"
    assert not engine.has_unfinished()
    assert r.xpending(KEYS.batches("echo"), WORKERS_GROUP)["pending"] == 0


def test_requests_cancelled_while_running_keep_their_started_at(redis_server):
    r = redis_server.client()
    _job(r, "jc", 8, per_batch=8)
    engine = EchoEngine(requests_per_step=1, step_delay=0.3, max_num_seqs=2)
    worker = Running(r, engine, cancel_poll_seconds=0.02)
    wait_until(lambda: len(_rows(r, "jc")) >= 1 and len(worker.daemon.book.running) == 2, what="two running")
    running = set(worker.daemon.book.running)
    JobStore(r, KEYS).cancel("jc")
    wait_until(lambda: len(_rows(r, "jc")) == 8)
    assert worker.stop() == 0
    rows = {x["request_id"]: x for x in _rows(r, "jc")}
    aborted = [rows[rid] for rid in running if rows[rid]["status"] == "cancelled"]
    assert aborted, "a request running at the cancel was aborted"
    for row in aborted:  # it ran: when it entered the engine is known; no completion, no finish_reason
        assert row["created_at"] <= row["started_at"] <= row["finished_at"]
        assert row["finish_reason"] is None and row["error_code"] == "cancelled"
    never = [x for x in rows.values() if x["status"] == "cancelled" and x["request_id"] not in running]
    assert never and all(x["started_at"] is None for x in never)  # waiting ones never started


def test_engine_errors_become_error_rows_and_the_worker_goes_on(redis_server):
    r = redis_server.client()
    JobStore(r, KEYS).create("j5", model="echo")
    reqs = [_request("j5", i, [1, 2, 3]) for i in range(8)]
    reqs.append(_request("j5", 8, list(range(1, 60))))  # longer than the engine's max_model_len
    reqs.append(_request("j5", 9, [1, 2], temperature=-1.0))  # sampling params the engine refuses

    def bad_request(rid):
        if rid == "j5:2":
            raise RuntimeError("postprocessing blew up")

    def bad_step(rids):  # a forward pass that fails whenever j5:5 is in it: who is to blame is unknown
        if any(rid.split("#")[0] == "j5:5" for rid in rids):  # a re-run has a fresh engine id
            raise RuntimeError("CUDA error: an illegal memory access")

    engine = FaultyEchoEngine(max_model_len=32, requests_per_step=8, fault_hook=bad_request,
                        step_fault_hook=bad_step)
    _dispatch(r, reqs[:5])
    _dispatch(r, reqs[5:])
    worker = Running(r, engine)
    wait_until(lambda: len(_rows(r, "j5")) == 10)
    rows = {x["idx"]: x for x in _rows(r, "j5")}
    assert rows[2]["status"] == "failed" and rows[2]["error_code"] == "engine_error"
    assert "postprocessing blew up" in rows[2]["error_message"]
    assert rows[5]["error_code"] == "engine_error" and "illegal memory access" in rows[5]["error_message"]
    assert rows[8]["error_code"] == "invalid_request" and "max_model_len" in rows[8]["error_message"]
    assert rows[9]["error_code"] == "invalid_request" and "temperature" in rows[9]["error_message"]
    assert all(rows[i]["status"] == "completed" for i in (0, 1, 3, 4, 6, 7))
    assert len(rows) == 10 and len(_rows(r, "j5")) == 10
    # ... and it keeps serving.
    JobStore(r, KEYS).create("j5b", model="echo")
    _dispatch(r, [_request("j5b", 0, [4, 4])])
    wait_until(lambda: len(_rows(r, "j5b")) == 1)
    assert worker.stop() == 0


def test_a_broken_engine_stops_the_worker_and_leaves_batches_to_their_leases(redis_server):
    r = redis_server.client()
    _job(r, "j6", 3, per_batch=3)

    def always(rids):
        raise RuntimeError("device lost")

    worker = Running(r, FaultyEchoEngine(step_fault_hook=always), max_failed_steps=4)
    worker.thread.join(timeout=30)
    assert worker.code == 3
    rows = _rows(r, "j6")
    assert len(rows) < 3  # bisection blamed a few alone before giving up; the rest is not lost:
    assert r.xpending(KEYS.batches("echo"), WORKERS_GROUP)["pending"] == 1


def test_malformed_batch_goes_to_the_dead_letter_stream(redis_server):
    r = redis_server.client()
    JobStore(r, KEYS).create("j7", model="echo")
    r.xgroup_create(KEYS.batches("echo"), WORKERS_GROUP, id="0", mkstream=True)
    r.xadd(KEYS.batches("echo"), {"v": "1", "requests": "not json"})
    r.xadd(KEYS.batches("echo"), {"v": "1", "requests": json.dumps([{"job_id": "j7", "idx": 0}])})
    _dispatch(r, [_request("j7", 1, [3, 3, 3])])
    worker = Running(r, EchoEngine())
    wait_until(lambda: len(_rows(r, "j7")) == 2)
    assert worker.stop() == 0
    rows = {x["idx"]: x for x in _rows(r, "j7")}
    assert rows[0]["error_code"] == "protocol_error" and rows[1]["status"] == "completed"
    dead = r.xrange(KEYS.deadletter)
    assert len(dead) == 1 and b"malformed batch entry" in dead[0][1][b"error"]
    assert r.xlen(KEYS.batches("echo")) == 0


def test_leases_survive_a_long_step_but_lapse_when_the_loop_is_stuck(redis_server):
    r = redis_server.client()
    stream = KEYS.batches("echo")

    def scheduler_claims(lease_ms: int) -> list:  # what the scheduler's lease check does
        return r.xautoclaim(stream, WORKERS_GROUP, "scheduler", lease_ms, justid=True)  # ids only

    _job(r, "j8", 1)
    worker = Running(r, EchoEngine(step_delay=4.0), settings=_settings(lease_seconds=1.5))
    wait_until(lambda: r.xpending(stream, WORKERS_GROUP)["pending"] == 1)
    stolen = []
    while len(_rows(r, "j8")) < 1:  # a 4 s step: three leases long
        stolen += scheduler_claims(1500)
        time.sleep(0.1)
    assert stolen == []
    assert worker.stop() == 0

    _job(r, "j9", 1)
    worker = Running(r, EchoEngine(step_delay=4.0), name="w2", settings=_settings(lease_seconds=0.6),
                     stall_seconds=1.0)  # the loop is "stuck" in step() for longer than it may be
    stolen = wait_until(lambda: scheduler_claims(600), timeout=10, what="the lease to lapse")
    assert len(stolen) == 1
    wait_until(lambda: len(_rows(r, "j9")) == 1)  # the row is still published once
    assert worker.stop() == 0
    pending = r.xpending_range(stream, WORKERS_GROUP, "-", "+", 10)
    assert [p["consumer"] for p in pending] in ([b"scheduler"], [])  # not taken back by the worker


def test_sigterm_drains_and_exits_zero(redis_server, tmp_path):
    r = redis_server.client()
    _job(r, "jt", 12, per_batch=12, total=False)
    code = ("import sys; from batchinfer.config import Settings; "
            "from batchinfer.workers.service.serve import main; "
            "sys.exit(main(Settings.from_env(), None, name='wt', echo=True, "
            "engine_options={'requests_per_step': 1, 'step_delay': 0.1, 'max_num_seqs': 4}))")
    env = {**os.environ, "BATCHINFER_REDIS_URL": redis_server.url, "BATCHINFER_PREFIX": PREFIX,
           "BATCHINFER_HEARTBEAT_SECONDS": "0.2"}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=tmp_path)
    try:
        wait_until(lambda: len(_rows(r, "jt")) >= 1, timeout=60, what="a first row")
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: r.hget(KEYS.worker("wt"), "state") == b"draining" or proc.poll() is not None)
        late = _dispatch(r, [_request("late", 0, [1])])  # after SIGTERM: must not be pulled
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert sorted(x["idx"] for x in _rows(r, "jt")) == list(range(12))  # everything held was finished
    assert r.xpending(KEYS.batches("echo"), WORKERS_GROUP)["pending"] == 0
    assert [e[0].decode() for e in r.xrange(KEYS.batches("echo"))] == [late]
    assert Registry(r, KEYS).live_workers() == []


def test_real_engine_matches_in_process_generation(redis_server, tiny_llama):
    from batchinfer.workers.engine.engine import Engine

    def engine():
        return Engine.from_model(tiny_llama, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=64)

    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16], [17], [18, 19, 20]]
    expected = {}
    local = engine()
    for i, p in enumerate(prompts):
        local.add_request(str(i), prompt_token_ids=p, sampling_params={"max_tokens": 6, "temperature": 0.0})
    while local.has_unfinished():
        for out in local.step():
            if out.finished:
                expected[int(out.request_id)] = out.outputs[0].token_ids

    r = redis_server.client()
    model = Path(tiny_llama).name
    JobStore(r, KEYS).create("jm", model=model)
    reqs = [_request("jm", i, p, model=model, max_tokens=6) for i, p in enumerate(prompts)]
    _dispatch(r, reqs[:3], model=model)
    _dispatch(r, reqs[3:], model=model)
    worker = Running(r, engine(), name="wm")
    wait_until(lambda: len(_rows(r, "jm")) == 5, timeout=120)
    assert worker.stop() == 0
    got = {x["idx"]: x["output_token_ids"] for x in _rows(r, "jm")}
    assert got == expected
    files = Registry(r, KEYS).get_model(model).files
    assert files["tokenizer.json"] == (Path(tiny_llama) / "tokenizer.json").read_bytes()


def test_echo_engine_echoes_prompts_and_hands_out_aborts():
    from batchinfer.workers.sampling_params import SamplingParams

    e = EchoEngine(requests_per_step=2, max_model_len=24)
    assert e.tokenizer.encode("hé") == [104, 195, 169] and e.tokenizer.decode([104, 105]) == "hi"
    e.add_request("a", prompt="hello")
    e.add_request("b", prompt_token_ids=[104, 105],
                  sampling_params=SamplingParams(max_tokens=5, min_tokens=5, n=2))
    e.add_request("c", prompt_token_ids=[1, 2])
    with pytest.raises(ValueError, match="max_model_len"):
        e.add_request("d", prompt_token_ids=[1] * 10, sampling_params={"max_tokens": 15})
    with pytest.raises(ValueError, match="already in the engine"):
        e.add_request("c", prompt_token_ids=[1])
    first = e.step()
    assert [o.request_id for o in first] == ["a", "b"] and all(o.finished for o in first)
    assert first[0].outputs[0].text == "hello" and first[0].outputs[0].finish_reason == "stop"
    assert [c.token_ids for c in first[1].outputs] == [[104, 105, 104, 105, 104]] * 2
    assert first[1].outputs[1].finish_reason == "length" and e.num_unfinished() == 1
    e.abort("c")
    assert e.has_unfinished() and e.num_unfinished() == 0
    (aborted,) = e.step()
    assert aborted.request_id == "c" and aborted.outputs[0].finish_reason == "abort"
    assert not e.has_unfinished()


def test_worker_survives_a_redis_restart(redis_server, caplog):
    r = redis_server.client()
    worker = Running(r, EchoEngine())
    wait_until(lambda: Registry(r, KEYS).get_model("echo"))
    with caplog.at_level(logging.WARNING, logger="batchinfer.workers.service.daemon"):
        redis_server.stop()
        wait_until(lambda: any("Redis unavailable" in rec.getMessage() for rec in caplog.records),
                   what="the worker's loop to meet the outage")  # and back off
    redis_server.start()  # an empty Redis: no persistence in tests
    r = redis_server.client()
    wait_until(lambda: Registry(r, KEYS).get_model("echo"), what="the model registered again")
    JobStore(r, KEYS).create("jr", model="echo")
    _dispatch(r, [_request("jr", 0, [7, 8, 9])])
    wait_until(lambda: len(_rows(r, "jr")) == 1, what="a row after the restart")
    assert worker.stop() == 0


def test_engine_failure_is_retried_then_dead_lettered_and_its_batch_completes(redis_server):
    """A poison request counts an attempt per failure (re-dispatched each time) and is dead-lettered
    with its engine_error row at max_attempts; a request that fails once completes on its retry."""
    r = redis_server.client()
    JobStore(r, KEYS).create("jp", model="echo")
    poison = list(b"xx POISON xx")
    reqs = [_request("jp", i, poison if i == 3 else [40 + i, 41, 42]) for i in range(8)]
    flaky = {"jp:5"}  # fails its first try only (a transient fault)

    def once(rid):
        rid = rid.split("#")[0]  # a re-run after bisection has a fresh engine id
        if rid in flaky:
            flaky.discard(rid)
            raise RuntimeError("transient")

    _dispatch(r, reqs)
    engine = FaultyEchoEngine(requests_per_step=2, max_num_seqs=8, poison="POISON", fault_hook=once)
    worker = Running(r, engine, settings=_settings(max_attempts=3))
    wait_until(lambda: len(_rows(r, "jp")) == 8, what="8 rows")
    wait_until(lambda: r.xlen(KEYS.batches("echo")) == 0, what="every batch acked")
    assert worker.stop() == 0
    rows = {x["idx"]: x for x in _rows(r, "jp")}
    assert len(_rows(r, "jp")) == 8
    assert rows[3]["status"] == "failed" and rows[3]["error_code"] == "engine_error"
    assert "3 time(s)" in rows[3]["error_message"] and "POISON" in rows[3]["error_message"]
    assert all(rows[i]["status"] == "completed" for i in range(8) if i != 3)
    assert r.hgetall(KEYS.attempts("jp")) == {b"3": b"3", b"5": b"1"}
    dead = r.xrange(KEYS.deadletter)
    assert len(dead) == 1 and json.loads(dead[0][1][b"request"])["request_id"] == "jp:3"
    assert dead[0][1][b"worker"] == b"w1" and json.loads(dead[0][1][b"request"])["attempts"] == 2
    assert r.xpending(KEYS.batches("echo"), WORKERS_GROUP)["pending"] == 0


class RecordingEcho(EchoEngine):
    """The echo engine, recording which requests were in it at every step."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.steps: list[set[str]] = []

    def step(self):
        self.steps.append(set(self._waiting))
        return super().step()


def test_a_solo_batch_runs_alone_and_nothing_is_pulled_while_it_is_held(redis_server):
    """A request on its last attempt (a ``solo`` batch): what the worker holds finishes first, then
    it runs alone, and the next batch is pulled only once its row is queued."""
    r = redis_server.client()
    JobStore(r, KEYS).create("js", model="echo")
    reqs = [_request("js", i, [10 + i, 20, 30]) for i in range(9)]
    _dispatch(r, reqs[:4])
    _dispatch(r, reqs[4:5], solo=True)
    _dispatch(r, reqs[5:])
    Publisher(r, KEYS).finish_submission("js", 9)
    engine = RecordingEcho(requests_per_step=1, max_num_seqs=8)
    worker = Running(r, engine)
    wait_until(lambda: len(_rows(r, "js")) == 9, what="9 rows")
    assert worker.stop() == 0
    assert all(row["status"] == "completed" for row in _rows(r, "js"))
    with_solo = [i for i, inside in enumerate(engine.steps) if "js:4" in inside]
    assert with_solo and all(engine.steps[i] == {"js:4"} for i in with_solo)
    assert any("js:0" in inside for inside in engine.steps[:with_solo[0]])  # the first batch ran before
    later = {f"js:{i}" for i in range(5, 9)}
    assert not any(inside & later for inside in engine.steps[:with_solo[-1] + 1])
