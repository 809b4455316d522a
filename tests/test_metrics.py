"""Metrics: counters scraped over HTTP move by the expected amounts; Redis-held state is read at scrape.

The job test drives the real pieces a scheduler and a worker use (intake stream, JobStore, batch
stream, EchoEngine, exactly-once Publisher) in a scripted order and calls the metrics hooks where
the daemons call them, scraping both daemons' /metrics before and after.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from batchinfer.keys import SCHEDULER_GROUP, WORKERS_GROUP, Keys
from batchinfer.ops.httpserver import HealthServer
from batchinfer.ops.metrics import QUEUE_GAUGES, SPECS, SchedulerMetrics, ThroughputWindow, WorkerMetrics
from batchinfer.protocol.entries import IntakeEntry
from batchinfer.protocol.rows import BatchRequest, ResultRow
from batchinfer.store.jobstore import JobStore
from batchinfer.store.publish import Publisher
from batchinfer.store.queue_state import JobStatusCounter, stream_state
from batchinfer.store.registry import Registry
from batchinfer.workers.engine.outputs import CompletionOutput, RequestOutput
from batchinfer.workers.sampling_params import SamplingParams
from batchinfer.workers.service.echo_engine import EchoEngine
from batchinfer.workers.service.rows import generation_row

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(server: HealthServer) -> Samples:
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sample ``name{labels}``; a missing one fails the test (absence is asserted with ``in``)."""
    key = (name, tuple(sorted(labels.items())))
    if key not in samples:
        near = sorted(str(dict(k[1])) for k in samples if k[0] == name)
        pytest.fail(f"no sample {name}{dict(labels)} in the scrape; that name has {near or 'no samples'}")
    return samples[key]


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.fixture
def servers(health_servers):
    return health_servers


def test_a_job_moves_the_counters_by_the_expected_amounts(redis_server, servers):
    r, keys = redis_server.client(), Keys("{mjob}")
    sched = SchedulerMetrics(redis_client=r, keys=keys)
    worker = WorkerMetrics("echo", worker="w1", device="cpu")
    s_http, w_http = servers(sched.registry), servers(worker.registry)
    s0, w0 = scrape(s_http), scrape(w_http)

    # a client submits 4 lines of a job, the last one bad
    jobs, publisher = JobStore(r, keys), Publisher(r, keys)
    job = jobs.create(model="echo")
    r.xgroup_create(keys.requests, SCHEDULER_GROUP, id="0", mkstream=True)
    r.xgroup_create(keys.batches("echo"), WORKERS_GROUP, id="0", mkstream=True)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    for idx, body in enumerate([*({"prompt_token_ids": p} for p in prompts), {"prompt": 1}]):
        r.xadd(keys.requests, IntakeEntry(json.dumps(body), job.id, idx, idx + 1).to_fields())
    publisher.finish_submission(job.id, 4)
    Registry(r, keys).heartbeat_worker("w1", {"model": "echo"}, ttl=60)
    r.sadd(keys.models, "echo")
    assert value(scrape(s_http), "batchinfer_intake_lag_requests") == 4

    # scheduler: read the intake, reject the bad line, pack the rest into one batch
    entries = r.xreadgroup(SCHEDULER_GROUP, "s1", {keys.requests: ">"}, count=10)[0][1]
    sched.intake_read(len(entries))
    bad = ResultRow.error("invalid_request", "prompt: expected a string", job_id=job.id, idx=3, line=4,
                          model="echo")
    assert publisher.publish(bad).published
    sched.row_published(bad)
    batch = [BatchRequest(f"{job.id}:{i}", job.id, i, p, SamplingParams(max_tokens=4).to_dict(), "echo")
             for i, p in enumerate(prompts)]
    r.xadd(keys.batches("echo"), {"v": "1", "requests": json.dumps([b.to_dict() for b in batch])})
    sched.batch_dispatched("echo", len(batch), sum(len(p) + 4 for p in prompts))
    sched.set_pending("echo", 0)
    r.xack(keys.requests, SCHEDULER_GROUP, *[e[0] for e in entries])
    mid = scrape(s_http)
    assert value(mid, "batchinfer_batches_queued", model="echo") == 1
    assert value(mid, "batchinfer_intake_lag_requests") == 0
    assert value(mid, "batchinfer_intake_unacked_requests") == 0

    # worker: pull the batch, run the engine, publish each row exactly once
    (entry_id, fields), = r.xreadgroup(WORKERS_GROUP, "w1", {keys.batches("echo"): ">"}, count=1)[0][1]
    assert value(scrape(s_http), "batchinfer_batches_in_flight", model="echo") == 1
    engine = EchoEngine("echo")
    requests = [BatchRequest.from_dict(d) for d in json.loads(fields[b"requests"])]
    for req in requests:
        engine.add_request(req.request_id, prompt_token_ids=req.prompt_token_ids,
                           sampling_params=req.params())
        worker.request_started(req.request_id)
    outputs = engine.step()
    worker.step_done(outputs, seconds=0.02)
    worker.set_engine_state(running=0, waiting=0, kv_usage=0.25)
    by_id = {req.request_id: req for req in requests}
    rows = [generation_row(by_id[o.request_id], o, worker="w1") for o in outputs]
    for row in rows:
        if publisher.publish(row).published:
            worker.row_published(row)
    for row in rows[:1]:  # a re-run after a lease expiry: the publish refuses, nothing is counted
        if publisher.publish(row).published:
            worker.row_published(row)
    r.xack(keys.batches("echo"), WORKERS_GROUP, entry_id)

    s1, w1 = scrape(s_http), scrape(w_http)
    generated = sum(row.completion_tokens for row in rows)
    assert generated == sum(min(4, len(p)) for p in prompts)
    completed = ("batchinfer_requests_completed_total", (("model", "echo"),))
    assert completed not in w0 and w1[completed] == 3  # the series starts with the first completed row
    delta_w = {name: value(w1, name, **labels) - value(w0, name, **labels) for name, labels in [
        ("batchinfer_generation_tokens_total", {"model": "echo"}),
        ("batchinfer_prompt_tokens_total", {"model": "echo"}),
        ("batchinfer_prefix_cache_queried_tokens_total", {"model": "echo"}),
        ("batchinfer_step_duration_seconds_count", {"model": "echo"}),
        ("batchinfer_step_tokens_sum", {"model": "echo"}),
        ("batchinfer_time_to_first_token_seconds_count", {"model": "echo"}),
        ("batchinfer_request_inference_seconds_count", {"model": "echo"}),
        ("batchinfer_e2e_request_latency_seconds_count", {"model": "echo"}),
    ]}
    assert delta_w == {
        "batchinfer_generation_tokens_total": generated,
        "batchinfer_prompt_tokens_total": 9, "batchinfer_prefix_cache_queried_tokens_total": 9,
        "batchinfer_step_duration_seconds_count": 1, "batchinfer_step_tokens_sum": 9 + generated,
        "batchinfer_time_to_first_token_seconds_count": 3, "batchinfer_request_inference_seconds_count": 3,
        # rows built without created_at (no intake time) have no end-to-end latency
        "batchinfer_e2e_request_latency_seconds_count": 0,
    }
    assert value(w1, "batchinfer_kv_cache_usage_ratio", model="echo") == 0.25
    assert value(w1, "batchinfer_worker_info", worker="w1", model="echo", device="cpu") == 1
    received = "batchinfer_requests_received_total"
    assert value(s1, received) - value(s0, received) == 4
    assert value(s1, "batchinfer_requests_failed_total", model="echo", code="invalid_request") == 1
    assert value(s1, "batchinfer_batches_dispatched_total", model="echo") == 1
    assert value(s1, "batchinfer_batch_requests_sum", model="echo") == 3
    assert value(s1, "batchinfer_batches_in_flight", model="echo") == 0
    assert value(s1, "batchinfer_jobs", status="finalizing") == 1
    assert value(s1, "batchinfer_live_workers", model="echo") == 1
    assert value(s1, "batchinfer_redis_up") == 1
    assert value(s1, "process_resident_memory_bytes") > 0


def out(request_id: str, prompt: int, tokens: int, *, finished: bool = False, cached: int = 0,
        reason: str | None = None) -> RequestOutput:
    completion = CompletionOutput(0, token_ids=list(range(tokens)),
                                  finish_reason=reason if finished else None)
    return RequestOutput(request_id, list(range(prompt)), [completion], num_cached_tokens=cached,
                         finished=finished)


def test_step_hooks_time_first_tokens_and_count_new_tokens_only():
    clock = [100.0]
    m = WorkerMetrics("m", clock=lambda: clock[0])
    m.request_started("a")
    m.request_started("b")
    clock[0] = 101.0
    m.step_done([out("a", 6, 1, cached=2), out("b", 4, 0)], seconds=1.0)  # b still in chunked prefill
    clock[0] = 103.0
    m.step_done([out("a", 6, 2, cached=2), out("b", 4, 1)], seconds=2.0)
    clock[0] = 104.0
    m.step_done([out("a", 6, 3, finished=True, reason="length", cached=2),
                 out("b", 4, 1, finished=True, reason="abort")], seconds=1.0)
    assert m.prompt_tokens._value.get() == 10
    assert m.generation_tokens._value.get() == 3 + 1
    assert m.ttft._sum.get() == pytest.approx(1.0 + 3.0)  # a at 101, b at 103, both admitted at 100
    assert m.inference._sum.get() == pytest.approx(4.0)  # only a: b was aborted
    # computed tokens: step 1 = 6 - 2 cached + 1, step 2 = 4 + 1 + 1, step 3 = 1
    assert m.step_tokens._sum.get() == 5 + 6 + 1
    assert m.heartbeat_fields()["tokens_per_s"] == pytest.approx((10 + 4) / 4, abs=0.05)


def test_engine_state_is_validated_and_reported_to_the_heartbeat():
    m = WorkerMetrics("m", device="cuda:0")
    m.set_engine_state(running=3, waiting=5, kv_usage=0.5)
    assert m.heartbeat_fields() == {"tokens_per_s": 0.0, "running": 3, "waiting": 5, "kv_usage": 0.5,
                                    "device": "cuda:0"}
    with pytest.raises(ValueError, match="kv_usage"):
        m.set_engine_state(running=0, waiting=0, kv_usage=1.5)
    m.set_engine_state(running=3, waiting=5, preemptions=2)
    m.set_engine_state(running=3, waiting=5, preemptions=2)  # cumulative: no new preemption
    m.set_engine_state(running=3, waiting=5, preemptions=7)
    assert m.preemptions._value.get() == 7


def test_gauges_follow_the_engine_state_when_it_moves_and_stays():
    m = WorkerMetrics("m")
    states = [(3, 5, 0.5), (3, 5, 0.5), (0, 5, 0.5), (0, 0, 0.0), (0, 0, 0.0), (2, 0, 0.25)]
    for running, waiting, kv in states:
        m.set_engine_state(running=running, waiting=waiting, kv_usage=kv)
        gauges = (m.running._value.get(), m.waiting._value.get(), m.kv_usage._value.get())
        assert gauges == (running, waiting, kv)
        assert {k: m.heartbeat_fields()[k] for k in ("running", "waiting", "kv_usage")} == \
            {"running": running, "waiting": waiting, "kv_usage": kv}
    m.set_engine_state(running=1, waiting=1)  # no kv figure: the gauge keeps its last value
    assert (m.running._value.get(), m.kv_usage._value.get()) == (1, 0.25)


def test_rows_published_at_once_count_as_one_by_one():
    def row(i: int, model: str | None, status: str = "completed", code: str | None = None, **kw) -> ResultRow:
        return ResultRow(job_id="j", request_id=f"j:{i}", idx=i, status=status, model=model,
                         error_code=code, **kw)

    rows = [row(0, "m", prompt_tokens=10, cached_tokens=4, created_at=1_000, finished_at=1_250),
            row(1, "m", prompt_tokens=6, created_at=1_000, finished_at=4_000),
            row(2, "other", prompt_tokens=3, cached_tokens=3),
            row(3, "m", "failed", "engine_error", prompt_tokens=9, created_at=1_000, finished_at=2_000),
            row(4, None, "failed", "engine_error"), row(5, "m", "failed", "engine_error"),
            row(6, "m", "cancelled"), row(7, "m", embeddings=["AAAA"], prompt_tokens=5)]
    one_by_one, at_once = WorkerMetrics("m"), WorkerMetrics("m")
    for r in rows:
        one_by_one.row_published(r)
    at_once.rows_published(rows[:3])
    at_once.rows_published(rows[3:])

    def samples(m: WorkerMetrics) -> dict:
        return {(s.name, tuple(sorted(s.labels.items()))): s.value for fam in m.registry.collect()
                for s in fam.samples if s.name.startswith(("batchinfer_requests", "batchinfer_prefix",
                                                           "batchinfer_e2e"))
                and not s.name.endswith("_created")}

    got = samples(at_once)
    assert got == samples(one_by_one)
    assert got[("batchinfer_requests_completed_total", (("model", "m"),))] == 3
    assert got[("batchinfer_requests_failed_total", (("code", "engine_error"), ("model", "m")))] == 2
    assert got[("batchinfer_requests_failed_total", (("code", "cancelled"), ("model", "m")))] == 1
    assert got[("batchinfer_prefix_cache_queried_tokens_total", (("model", "m"),))] == 19
    assert got[("batchinfer_prefix_cache_hit_tokens_total", (("model", "m"),))] == 7
    assert got[("batchinfer_e2e_request_latency_seconds_count", (("model", "m"),))] == 2


def test_throughput_window_forgets_old_steps():
    clock = [0.0]
    window = ThroughputWindow(window_s=10, clock=lambda: clock[0])
    clock[0] = 5.0
    window.add(50)
    assert window.rate() == 10.0  # 50 tokens over the 5 s it has existed
    clock[0] = 30.0
    assert window.rate() == 0.0


def test_scheduler_and_worker_share_one_registry_in_one_process():
    worker = WorkerMetrics("m")
    sched = SchedulerMetrics(registry=worker.registry)
    sched.request_dead_lettered("m", 2)
    worker.row_published(ResultRow(job_id="j", request_id="j:0", idx=0, status="completed", model="m"))
    sched.row_published(ResultRow(job_id="j", request_id="j:1", idx=1, status="expired", model="m",
                                  error_code="expired"))
    text = worker.render().decode()
    assert 'batchinfer_requests_dead_lettered_total{model="m"} 2.0' in text
    assert 'batchinfer_requests_completed_total{model="m"} 1.0' in text
    assert 'batchinfer_requests_failed_total{code="expired",model="m"} 1.0' in text


def test_every_metric_follows_prometheus_naming():
    for name, spec in SPECS.items():
        assert name.startswith("batchinfer_")
        kind = spec.kind.__name__
        assert (kind == "Counter") == name.endswith("_total"), name
        if "seconds" in name or "bytes" in name:
            assert name.endswith(("_seconds", "_bytes")), name


def test_stream_lag_is_counted_when_redis_cannot_tell(redis_server):
    r = redis_server.client()
    ids = [r.xadd("s", {"n": i}, id=f"{1000 + i}-0") for i in range(5)]
    r.xgroup_create("s", "g", id="0")
    r.xreadgroup("g", "c", {"s": ">"}, count=2)
    state = stream_state(r, "s", "g")
    assert (state.undelivered, state.unacked, state.oldest_undelivered_ms) == (3, 2, 1002)
    r.xdel("s", ids[3])  # a tombstone after the group's position: XINFO reports lag nil
    assert r.xinfo_groups("s")[0]["lag"] is None
    state = stream_state(r, "s", "g")
    assert state.undelivered == 2 and state.lag_seconds(now=4002) == 3.0
    assert stream_state(r, "absent", "g").length == 0


def test_unreachable_redis_is_reported_as_down_and_the_scrape_still_works(redis_server, servers):
    sched = SchedulerMetrics(redis_client=redis_server.client(), keys=Keys("{down}"))
    http = servers(sched.registry)
    assert value(scrape(http), "batchinfer_redis_up") == 1
    redis_server.stop(kill=True)
    samples = scrape(http)
    assert value(samples, "batchinfer_redis_up") == 0
    assert ("batchinfer_intake_lag_requests", ()) not in samples


def test_the_grafana_dashboard_uses_exactly_the_metrics_we_export():
    dashboard = json.loads((Path(__file__).parents[1] / "deploy/grafana/batchinfer.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    names = {name for e in exprs for name in re.findall(r"batchinfer_\w+", e)}
    used = {re.sub(r"_(bucket|sum|count)$", "", name) for name in names}
    exported = set(SPECS) | {name for name, _, _ in QUEUE_GAUGES.values()}
    assert used <= exported, f"dashboard queries unknown metrics: {sorted(used - exported)}"
    assert exported <= used, f"metrics missing from the dashboard: {sorted(exported - used)}"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_job_counts_reread_only_unfinished_jobs(redis_server):
    r, keys = redis_server.client(), Keys("{jc}")
    for i, status in enumerate(["in_progress", "completed", "failed", "validating"]):
        r.hset(keys.job(f"j{i}"), mapping={"id": f"j{i}", "status": status})
        r.zadd(keys.jobs, {f"j{i}": i})
    counter = JobStatusCounter(max_jobs=3)  # the 3 most recent: j3, j2, j1
    assert {k: v for k, v in counter.count(r, keys).items() if v} == {"validating": 1, "failed": 1,
                                                                       "completed": 1}
    r.hset(keys.job("j3"), "status", "in_progress")  # unfinished: read again
    r.hset(keys.job("j1"), "status", "bogus")  # finished jobs never change: not read again
    c = counter.count(r, keys)
    assert (c["in_progress"], c["completed"], c["failed"], c["validating"]) == (1, 1, 1, 0)
    assert "bogus" not in c
    r.zrem(keys.jobs, "j1", "j2", "j3")  # cleaned up: forgotten
    assert {k: v for k, v in counter.count(r, keys).items() if v} == {"in_progress": 1}
