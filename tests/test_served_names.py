"""Served model names (vLLM's ``--served-model-name``): one worker, a canonical name and aliases.

A real redis-server, the in-process scheduler and a worker daemon with the echo engine: a request
naming an alias is tokenised with the canonical model's tokenizer, batched on the canonical
model's stream and answered, its row naming the model as the request did.
"""

from __future__ import annotations

import json

import pytest
from daemons import ThreadedWorker, wait_until, worker_daemon

from batchinfer.config import Settings
from batchinfer.keys import Keys
from batchinfer.protocol.entries import IntakeEntry
from batchinfer.protocol.rows import ResultRow
from batchinfer.scheduler.daemon import SchedulerDaemon
from batchinfer.store.jobstore import JobStore
from batchinfer.store.registry import Registry, ServedNameTaken
from batchinfer.workers.service.echo_engine import EchoEngine
from batchinfer.workers.service.worker_config import WorkerConfig

PREFIX = "{s}"
KEYS = Keys(PREFIX)


def _settings() -> Settings:
    return Settings(prefix=PREFIX, heartbeat_seconds=0.2)




def Serving(r, engine, name, **kw) -> ThreadedWorker:  # noqa: N802 - reads as a class
    """A worker daemon in a thread; ``stop()`` drains it."""
    return ThreadedWorker(worker_daemon(r, _settings(), engine, name, **kw))


def _scheduler(r) -> SchedulerDaemon:
    sched = SchedulerDaemon(r, Settings(prefix=PREFIX), direct_hold_s=60)
    sched.admission.models.refresh = 0  # see registrations at once
    sched.dispatcher.jobs.ttl = sched.admission.jobs.ttl = 0
    return sched


def _rows(r, stream: str) -> list[ResultRow]:
    return [ResultRow.from_json(f[b"row"]) for _, f in r.xrange(stream)]


# -- WorkerConfig -------------------------------------------------------------------------------

def test_worker_config_names():
    assert WorkerConfig(model="SmolLM2").served_model_names == ["SmolLM2"]  # the folder's name
    assert WorkerConfig(model="SmolLM2", model_name="smol").served_model_names == ["smol"]  # the old flag
    cfg = WorkerConfig(model="SmolLM2", served_model_names=["smol", "gpt-4o-mini", "smol"])
    assert (cfg.canonical, cfg.aliases) == ("smol", ["gpt-4o-mini"])  # a repeated name is served once
    assert WorkerConfig(model="m", served_model_names="one").served_model_names == ["one"]
    assert WorkerConfig(model="m", model_name="a", served_model_names=["a", "b"]).aliases == ["b"]
    with pytest.raises(ValueError, match="model_name 'x' and served_model_names"):
        WorkerConfig(model="m", model_name="x", served_model_names=["a", "b"])
    for bad in ([""], ["has space"], [None]):
        with pytest.raises(ValueError, match="^served_model_names must be a non-empty name"):
            WorkerConfig(model="m", served_model_names=bad)


# -- routing ------------------------------------------------------------------------------------

def test_a_request_naming_an_alias_is_answered_by_the_canonical_model(redis_server):
    r = redis_server.client()
    sched = _scheduler(r)
    # sent before any worker serves the alias: held, then answered once the worker registers it
    r.xadd(KEYS.requests, IntakeEntry(body=json.dumps({"prompt": "early", "model": "gpt-4o-mini",
                                                       "max_tokens": 3}), reply_to="{s}:reply:a").to_fields())
    sched.run_once()
    assert r.xlen(KEYS.held) == 1
    worker = Serving(r, EchoEngine(requests_per_step=4), "w1",
                     served_model_names=["echo", "gpt-4o-mini", "hosted"])
    wait_until(lambda: Registry(r, KEYS).resolve_alias("hosted") == "echo", what="aliases registered")
    JobStore(r, KEYS).create("j", model="hosted")
    bodies = [{"prompt": "hi there", "max_tokens": 2},
              {"prompt": "again", "max_tokens": 2, "model": "hosted"}]
    for i, body in enumerate(bodies):
        r.xadd(KEYS.requests, IntakeEntry(body=json.dumps(body), job_id="j", idx=i, line=i + 1).to_fields())
    canonical_body = json.dumps({"prompt": "canonical", "model": "echo", "max_tokens": 2})
    r.xadd(KEYS.requests, IntakeEntry(body=canonical_body, reply_to="{s}:reply:b").to_fields())
    sched.timers["held"].last = float("-inf")  # sweep the holding area now
    wait_until(lambda: len(_rows(r, KEYS.results("j"))) == 2
               and r.xlen("{s}:reply:a") and r.xlen("{s}:reply:b"),
               tick=sched.run_once, what="every row")
    assert worker.stop() == 0
    job_rows = sorted(_rows(r, KEYS.results("j")), key=lambda row: row.idx)
    assert [row.status for row in job_rows] == ["completed", "completed"]
    assert [row.output_text for row in job_rows] == ["hi", "ag"]  # the echo engine answered
    # rows name the model as the request did (as vLLM does), every one ran on the canonical stream
    assert [row.model for row in job_rows] == ["hosted", "hosted"]
    (early,) = _rows(r, "{s}:reply:a")
    assert (early.status, early.model, early.output_text) == ("completed", "gpt-4o-mini", "ear")
    (canonical,) = _rows(r, "{s}:reply:b")
    assert (canonical.status, canonical.model) == ("completed", "echo")
    assert not r.exists(KEYS.batches("hosted")) and not r.exists(KEYS.batches("gpt-4o-mini"))
    assert Registry(r, KEYS).models() == ["echo"]  # aliases are no models of their own


def test_requests_staged_under_an_alias_share_priority_with_the_canonical_queue(redis_server):
    r = redis_server.client()
    sched = _scheduler(r)
    registry = Registry(r, KEYS)
    engine = EchoEngine()
    registry.register_model("echo", engine.tokenizer_files(), engine.capacity())
    registry.register_aliases("echo", ["alias"])
    # one live worker taking one request per batch: the dispatch order is the queue's order
    one_at_a_time = {"kv_tokens": 64, "max_num_seqs": 1}
    registry.heartbeat_worker("w", {"model": "echo", "capacity": one_at_a_time}, ttl=60)
    for body in ({"prompt": "low", "model": "echo"}, {"prompt": "high", "model": "alias", "priority": 5}):
        r.xadd(KEYS.requests, IntakeEntry(body=json.dumps({**body, "max_tokens": 2}),
                                          reply_to="{s}:reply:x").to_fields())
    wait_until(lambda: r.xlen(KEYS.batches("echo")) == 2, tick=sched.run_once, what="two batches")
    first, second = (json.loads(f[b"requests"]) for _, f in r.xrange(KEYS.batches("echo")))
    assert [q["model"] for q in first + second] == ["alias", "echo"]  # priority 5 first, from either queue
    assert not r.exists(KEYS.batches("alias"))


# -- conflicts ----------------------------------------------------------------------------------

def test_an_alias_a_live_worker_of_another_model_serves_is_refused_at_start(redis_server):
    r = redis_server.client()
    first = Serving(r, EchoEngine(), "w1", served_model_names=["echo", "shared"])
    wait_until(lambda: Registry(r, KEYS).resolve_alias("shared") == "echo", what="first worker registered")
    other = Serving(r, EchoEngine("other"), "w2", served_model_names=["other", "shared"])
    other.thread.join(timeout=10)
    assert isinstance(other.error, ServedNameTaken)
    assert "'shared' is already served by worker 'w1' for model 'echo'" in str(other.error)
    assert Registry(r, KEYS).resolve_alias("shared") == "echo"  # untouched
    assert [w.name for w in Registry(r, KEYS).live_workers()] == ["w1"]  # the refused one left nothing
    # a canonical name that is a live worker's alias is refused the same way
    clash = Serving(r, EchoEngine("shared"), "w3")
    clash.thread.join(timeout=10)
    assert isinstance(clash.error, ServedNameTaken)
    assert first.stop() == 0
    # once the first worker is gone, the name is free: the alias is re-pointed
    again = Serving(r, EchoEngine("other"), "w2", served_model_names=["other", "shared"])
    wait_until(lambda: Registry(r, KEYS).resolve_alias("shared") == "other", what="alias taken over")
    assert again.stop() == 0 and again.error is None


def test_a_model_registered_under_a_name_that_becomes_an_alias_is_replaced(redis_server):
    r = redis_server.client()
    registry = Registry(r, KEYS)
    engine = EchoEngine()
    registry.register_model("old-name", engine.tokenizer_files(), engine.capacity())  # a worker long gone
    registry.register_aliases("elsewhere", ["echo"])  # "echo" was once an alias of a model now gone
    worker = Serving(r, engine, "w1", served_model_names=["echo", "old-name"])
    wait_until(lambda: registry.resolve_alias("old-name") == "echo", what="alias registered")
    assert registry.models() == ["echo"] and registry.get_model("old-name") is None
    assert registry.resolve_alias("echo") is None  # a name is a model or an alias, never both
    assert worker.stop() == 0
