"""Per-request LoRA adapters on the queue side, against a real redis-server: adapter models
(``BASE:NAME``) in the registry, intake's routing of ``NAME`` / ``BASE:NAME`` / ``ALIAS:NAME``,
unknown adapters answered at once, and dispatch / leases per adapter stream.

Models and worker heartbeats are registered with :class:`Registry` directly, as workers do
(``register_model(..., adapter=NAME)``, aliases, ``adapter_models`` in the heartbeat info).
"""

from __future__ import annotations

import json

import pytest
from daemons import wait_until

from batchinfer.config import Settings
from batchinfer.keys import WORKERS_GROUP, Keys
from batchinfer.protocol.entries import IntakeEntry
from batchinfer.protocol.rows import BatchRequest, ResultRow
from batchinfer.scheduler.daemon import SchedulerDaemon
from batchinfer.scheduler.lookups import ModelCache
from batchinfer.store.jobstore import JobStore
from batchinfer.store.registry import Registry, adapter_model_name
from batchinfer.workers.service.echo_engine import byte_tokenizer_files
from batchinfer.workers.text.tokenizer import Tokenizer

PREFIX = "{l}"
KEYS = Keys(PREFIX)
CAP = {"max_model_len": 256, "max_num_seqs": 4, "max_num_batched_tokens": 512, "kv_tokens": 4096}
ONE_AT_A_TIME = {**CAP, "max_num_seqs": 1}  # a worker taking one request per batch
FILES = byte_tokenizer_files()  # the echo engine's byte-level tokenizer
REPLY = "{l}:reply:x"


def serve_adapters(registry: Registry, base: str, adapters: list[str], aliases: tuple[str, ...] = ()) -> None:
    """What a worker serving ``base`` and ``adapters`` registers: each adapter as model BASE:NAME
    (the base's files and capacity), routed to by NAME and ALIAS:NAME."""
    for name in adapters:
        model = adapter_model_name(base, name)
        registry.register_model(model, FILES, CAP, adapter=name)
        registry.register_aliases(model, [name, *(f"{a}:{name}" for a in aliases)])


def heartbeat(registry: Registry, worker: str, base: str, adapters: list[str], cap: dict | None = None,
              **info) -> None:
    registry.heartbeat_worker(worker, {"model": base, "capacity": cap or CAP, "adapters": adapters,
                                       "adapter_models": [adapter_model_name(base, a) for a in adapters],
                                       **info}, ttl=60)


@pytest.fixture
def env(redis_server):
    r = redis_server.client()
    registry = Registry(r, KEYS)
    registry.register_model("base", FILES, CAP)
    registry.register_aliases("base", ["short"])
    serve_adapters(registry, "base", ["sql", "chat"], aliases=("short",))
    return r, registry


def make_scheduler(r, **settings) -> SchedulerDaemon:
    sched = SchedulerDaemon(r, Settings(prefix=PREFIX, **settings), direct_hold_s=600)
    sched.admission.models.refresh = sched.dispatcher.models.refresh = 0  # see registrations at once
    sched.dispatcher.jobs.ttl = sched.admission.jobs.ttl = 0
    return sched


def run_until_idle(sched: SchedulerDaemon, passes: int = 20) -> None:
    for _ in range(passes):
        if sched.run_once() == 0:
            return


def send(r, model: str | None, prompt: str = "hello", **fields) -> None:
    body = {"prompt": prompt, "max_tokens": 4, **({"model": model} if model else {})}
    r.xadd(KEYS.requests, IntakeEntry(body=json.dumps(body), **fields).to_fields())


def batches(r, model: str) -> list[list[BatchRequest]]:
    return [[BatchRequest.from_dict(q) for q in json.loads(f[b"requests"])]
            for _, f in r.xrange(KEYS.batches(model))]


def rows(r, stream: str) -> list[ResultRow]:
    return [ResultRow.from_json(f[b"row"]) for _, f in r.xrange(stream)]


# -- registry ------------------------------------------------------------------------------------

def test_an_adapter_model_registers_its_adapter_and_base_and_a_fingerprint_of_its_own(env):
    r, registry = env
    base, sql, chat = (registry.get_model(m) for m in ("base", "base:sql", "base:chat"))
    assert (base.adapter, base.base_model) == (None, None)
    assert (sql.adapter, sql.base_model, sql.name) == ("sql", "base", "base:sql")
    assert sql.files == base.files and sql.capacity == base.capacity  # the base's tokenizer and capacity
    # a cache keyed by fingerprint tells the base and each adapter apart
    assert len({base.fingerprint, sql.fingerprint, chat.fingerprint}) == 3
    assert registry.model_fingerprint("base:sql") == sql.fingerprint
    assert registry.adapters_of("base") == ["chat", "sql"]
    assert registry.adapters_of("short") == [] and registry.adapters_of("base:sql") == []
    # ModelCache: aliases resolve to the adapter model; the adapters share the base's one tokenizer
    cache = ModelCache(registry)
    names = ("short:sql", "sql", "base:chat", "base")
    by_alias, by_name, chat_model, base_model = (cache.get(m) for m in names)
    assert by_alias and by_name and chat_model and base_model
    assert by_alias.info.name == by_name.info.name == "base:sql" and by_alias.info.adapter == "sql"
    assert chat_model.tokenizer is base_model.tokenizer is by_alias.tokenizer


def test_register_model_refuses_an_adapter_that_does_not_fit_its_name(env):
    _, registry = env
    for name, adapter, why in (("base:sql", "chat", "is named BASE:chat"),
                               (":sql", "sql", "is named BASE:sql"), ("base", "base", "is named BASE:base"),
                               ("base:a:b", "a:b", "adapter name"), ("base:", "", "adapter name")):
        with pytest.raises(ValueError, match=why):
            registry.register_model(name, FILES, CAP, adapter=adapter)
    with pytest.raises(ValueError, match="an adapter model generates"):
        registry.register_model("base:emb", FILES, CAP, adapter="emb", task="embed", embedding_dim=8)
    assert registry.get_model("base").adapter is None  # nothing was written
    assert registry.models() == ["base", "base:chat", "base:sql"]


def test_live_workers_of_an_adapter_model_are_those_listing_it(env):
    _, registry = env
    heartbeat(registry, "w1", "base", ["sql"])
    heartbeat(registry, "w2", "base", ["chat"])
    assert [w.name for w in registry.live_workers("base")] == ["w1", "w2"]
    assert [w.name for w in registry.live_workers("base:sql")] == ["w1"]
    assert [w.name for w in registry.live_workers("base:chat")] == ["w2"]
    assert registry.live_workers("sql") == []  # an alias is no model: nobody lists it


def test_served_name_conflicts_know_adapter_models_and_their_aliases(env):
    _, registry = env
    heartbeat(registry, "w1", "base", ["sql"], served_model_names=["base", "short"])
    # a second worker of the same adapter model: no conflict
    assert registry.served_name_conflicts(["base:sql", "sql", "short:sql"], "base:sql", "w2") == []
    # a worker of another base may not take the short name w1's adapter is routed by
    (line,) = registry.served_name_conflicts(["other:sql", "sql"], "other:sql", "w3")
    assert line == "served model name 'sql' is already served by worker 'w1' for model 'base'"


# -- intake -------------------------------------------------------------------------------------

def test_requests_naming_an_adapter_are_batched_on_its_stream_with_lora_and_base_tokens(env):
    r, registry = env
    heartbeat(registry, "w1", "base", ["sql", "chat"])
    for i, model in enumerate(("sql", "base:sql", "short:sql", "base", "short")):
        send(r, model, prompt=f"prompt {i}", reply_to=REPLY)
    run_until_idle(make_scheduler(r))
    tok = Tokenizer.from_files(FILES["tokenizer.json"], FILES.get("tokenizer_config.json"))
    (adapter_batch,) = batches(r, "base:sql")
    # rows name the model as the request did; each runs with the adapter, on the base's tokens
    assert [q.model for q in adapter_batch] == ["sql", "base:sql", "short:sql"]
    assert [q.lora for q in adapter_batch] == ["sql"] * 3
    assert [q.prompt_token_ids for q in adapter_batch] == [tok.encode(f"prompt {i}") for i in range(3)]
    (base_batch,) = batches(r, "base")
    assert [(q.model, q.lora) for q in base_batch] == [("base", None), ("short", None)]
    for name in ("sql", "short:sql", "base:chat"):  # no stream of an alias; no batch for an idle adapter
        assert not r.exists(KEYS.batches(name))
    assert r.xlen(KEYS.held) == 0 and not rows(r, REPLY)


def test_a_jobs_model_may_name_an_adapter(env):
    r, registry = env
    heartbeat(registry, "w1", "base", ["sql"])
    JobStore(r, KEYS).create("j", model="short:sql")
    JobStore(r, KEYS).create("k", model="base:nope")
    for job in ("j", "k"):
        for idx, line_model in enumerate((None, "gpt-4o-mini")):
            send(r, line_model, job_id=job, idx=idx, line=idx + 1)
    run_until_idle(make_scheduler(r))
    (batch,) = batches(r, "base:sql")
    assert [(q.job_id, q.idx, q.model, q.lora) for q in batch] == [("j", 0, "short:sql", "sql"),
                                                                    ("j", 1, "short:sql", "sql")]
    record = JobStore(r, KEYS).get("j")
    assert record is not None and record.models_overridden == 1
    # a job's unknown adapter is answered at once, every row
    got = rows(r, KEYS.results("k"))
    assert [(row.idx, row.error_code) for row in got] == [(0, "unknown_model"), (1, "unknown_model")]
    record = JobStore(r, KEYS).get("k")
    assert record is not None and record.held == 0 and r.xlen(KEYS.held) == 0


def test_a_line_naming_an_adapter_of_the_jobs_model_keeps_it(env):
    # `batchinfer run FILE --model BASE --lora sql=DIR`: the job names the base, lines their adapters
    r, registry = env
    heartbeat(registry, "w1", "base", ["sql"])
    JobStore(r, KEYS).create("j", model="short")
    for idx, line_model in enumerate(("sql", "base:sql", "short:sql", "gpt-4o-mini", None, "base:nope")):
        send(r, line_model, job_id="j", idx=idx, line=idx + 1)
    run_until_idle(make_scheduler(r))
    (adapter_batch,) = batches(r, "base:sql")
    assert [(q.idx, q.model, q.lora) for q in adapter_batch] == [(0, "sql", "sql"), (1, "base:sql", "sql"),
                                                                  (2, "short:sql", "sql")]
    (base_batch,) = batches(r, "base")  # a line without a model runs on the job's
    assert [(q.idx, q.model, q.lora) for q in base_batch] == [(4, "short", None)]
    # with adapters served, another name is no longer answered by the base (issue 28): its row at once,
    # as is an adapter of the job's model nobody serves
    other, bad = rows(r, KEYS.results("j"))
    assert (other.idx, other.model, other.error_code) == (3, "gpt-4o-mini", "unknown_model")
    assert (bad.idx, bad.error_code) == (5, "unknown_model")
    assert "served adapters: chat, sql" in bad.error_message
    record = JobStore(r, KEYS).get("j")
    assert record is not None and record.models_overridden == 0


def test_with_adapters_served_a_line_naming_no_adapter_is_unknown_not_the_base(env):
    # `run --lora sql=DIR` and a line naming `sqll`: answered by the base before (issue 28)
    r, registry = env
    registry.register_model("other", FILES, CAP)
    heartbeat(registry, "w1", "base", ["sql", "chat"])
    JobStore(r, KEYS).create("j", model="base")
    for idx, line_model in enumerate(("sqll", "other", "short", "base", "chat")):
        send(r, line_model, job_id="j", idx=idx, line=idx + 1)
    run_until_idle(make_scheduler(r))
    got = rows(r, KEYS.results("j"))
    assert [(row.idx, row.model, row.error_code) for row in got] == [(0, "sqll", "unknown_model"),
                                                                    (1, "other", "unknown_model")]
    assert got[0].error_message == ("model 'sqll' is not served for the job's model 'base': neither it, an "
                                    "alias of it nor one of its adapters; served adapters: chat, sql")
    assert [(q.idx, q.lora) for q in batches(r, "base")[0]] == [(2, None), (3, None)]  # alias, base
    assert [(q.idx, q.lora) for q in batches(r, "base:chat")[0]] == [(4, "chat")]
    # without adapters the job's model answers every line (hosted names in OpenAI files)
    heartbeat(registry, "w2", "other", [])
    JobStore(r, KEYS).create("k", model="other")
    send(r, "gpt-4o-mini", job_id="k", idx=0, line=1)
    run_until_idle(make_scheduler(r))
    assert rows(r, KEYS.results("k")) == [] and [q.model for q in batches(r, "other")[0]] == ["other"]


def test_an_unknown_adapter_of_a_served_model_is_answered_at_once(env):
    r, registry = env
    registry.register_model("plain", FILES, CAP)
    heartbeat(registry, "w1", "base", ["sql"])
    for model in ("base:nope", "short:nope", "plain:x"):
        send(r, model, reply_to=REPLY)
    send(r, "ghost", reply_to=REPLY)  # a plain unknown name waits for its worker
    send(r, "ghost:x", reply_to=REPLY)  # so does an adapter of a model nobody serves
    make_scheduler(r).run_once()
    got = rows(r, REPLY)
    assert [(row.model, row.error_code) for row in got] == [("base:nope", "unknown_model"),
                                                           ("short:nope", "unknown_model"),
                                                           ("plain:x", "unknown_model")]
    assert [row.error_message for row in got] == [
        "model 'base:nope': adapter 'nope' is not served for model 'base'; served adapters: chat, sql",
        "model 'short:nope': adapter 'nope' is not served for model 'base'; served adapters: chat, sql",
        "model 'plain:x': adapter 'x' is not served for model 'plain'; served adapters: none"]
    held = [json.loads(f[b"body"])["model"] for _, f in r.xrange(KEYS.held)]
    assert held == ["ghost", "ghost:x"]


def test_a_model_name_holding_a_colon_is_a_base_of_its_own(env):
    r, registry = env
    registry.register_model("llama3", FILES, CAP)
    registry.register_model("llama3:8b", FILES, CAP)  # a plain model whose name holds ':'
    serve_adapters(registry, "llama3:8b", ["sql"])
    heartbeat(registry, "w8", "llama3:8b", ["sql"])
    assert registry.adapters_of("llama3") == []  # llama3:8b is no adapter of llama3
    assert registry.adapters_of("llama3:8b") == ["sql"]
    for model in ("llama3:8b", "llama3:8b:sql", "llama3:8b:nope"):
        send(r, model, reply_to=REPLY)
    run_until_idle(make_scheduler(r))
    def routed(model: str) -> list[list[tuple[str, str | None]]]:
        return [[(q.model, q.lora) for q in b] for b in batches(r, model)]

    assert routed("llama3:8b") == [[("llama3:8b", None)]]
    assert routed("llama3:8b:sql") == [[("llama3:8b:sql", "sql")]]
    (row,) = rows(r, REPLY)
    assert row.error_message == ("model 'llama3:8b:nope': adapter 'nope' is not served for model "
                                 "'llama3:8b'; served adapters: sql")


# -- dispatch and leases ------------------------------------------------------------------------

def test_each_adapters_batches_go_to_its_stream_when_a_live_worker_serves_it(env):
    r, registry = env
    serve_adapters(registry, "base", ["idle"])
    heartbeat(registry, "w1", "base", ["sql"], cap=ONE_AT_A_TIME)
    heartbeat(registry, "w2", "base", ["chat"])
    for model in ["sql"] * 3 + ["chat"] * 3 + ["idle"]:
        send(r, model, reply_to=REPLY)
    sched = make_scheduler(r)
    run_until_idle(sched)
    # sql: w1's budget (one request per batch), BATCHES_PER_WORKER = 2 ready for its one worker
    assert [[q.lora for q in b] for b in batches(r, "base:sql")] == [["sql"], ["sql"]]
    assert sched.dispatcher.staging.count("base:sql") == 1
    # chat: w2's budget, all three in one batch
    assert [[q.lora for q in b] for b in batches(r, "base:chat")] == [["chat"] * 3]
    # idle: registered, but no live worker lists it: staged, no stream
    assert sched.dispatcher.staging.count("base:idle") == 1 and not r.exists(KEYS.batches("base:idle"))
    assert not r.exists(KEYS.batches("base"))
    heartbeat(registry, "w3", "base", ["idle"])
    run_until_idle(sched)
    assert [[q.model for q in b] for b in batches(r, "base:idle")] == [["idle"]]
    assert sched.dispatcher.staging.count("base:idle") == 0


def test_an_expired_lease_on_an_adapter_stream_is_redispatched_there(env):
    r, registry = env
    heartbeat(registry, "w1", "base", ["sql"])
    send(r, "sql", reply_to=REPLY)
    # the idle time is Redis's clock (XAUTOCLAIM), not one a test can advance: a short lease, polled
    sched = make_scheduler(r, lease_seconds=0.05)
    run_until_idle(sched)
    stream = KEYS.batches("base:sql")
    (taken,) = r.xreadgroup(WORKERS_GROUP, "w1", {stream: ">"}, count=1)[0][1]  # w1 reads, then stalls
    assert wait_until(sched.leases.step, what="the lease to expire") == 1
    (again,) = batches(r, "base:sql")
    assert [(q.lora, q.attempts) for q in again] == [("sql", 1)]
    assert r.xrange(stream)[0][0] != taken[0] and not r.exists(KEYS.batches("base"))
