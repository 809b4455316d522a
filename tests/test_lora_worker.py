"""The worker side of per-request LoRA adapters (issue 15): one worker reads its model's batch stream
and one per adapter it serves, registers the adapters, reports them, and prefers adapters loaded
elsewhere less (cache affinity); the ``--lora`` flags.

Echo engines serve adapter names (their text is prefixed ``[NAME] ``, so a row shows which adapter
answered). Threaded daemons get batches written by hand as the scheduler writes them; the last
tests run the real scheduler and echo workers as subprocesses (:class:`daemons.Stack`).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from daemons import (
    FAULT_ENV,
    Stack,
    ThreadedWorker,
    assert_exactly_once,
    pending_of,
    wait_until,
    worker_daemon,
)
from faulty_echo import FaultyEchoEngine

from batchinfer.cli.daemons import lora_options, parse_lora_modules
from batchinfer.cli.main import cli
from batchinfer.config import Settings
from batchinfer.keys import WORKERS_GROUP, Keys
from batchinfer.protocol.rows import BatchRequest
from batchinfer.store.jobstore import JobStore
from batchinfer.store.publish import Publisher
from batchinfer.store.registry import Registry
from batchinfer.workers.service.echo_engine import EchoEngine, adapter_marker
from batchinfer.workers.service.inflight import Book
from batchinfer.workers.service.keeper import Keeper
from batchinfer.workers.service.outbox import Outbox
from batchinfer.workers.service.streams import BatchStreams, entry_key, split_key, streams_to_read

PREFIX = "{lw}"
KEYS = Keys(PREFIX)


# -- keys and the affinity policy (pure) -----------------------------------------------------------


def test_entry_keys_name_the_stream_and_round_trip():
    assert entry_key(None, "1700-0") == "1700-0"  # a base entry keys as before
    assert entry_key("sql", "1700-0") == "sql/1700-0"
    assert split_key("sql/1700-0") == ("sql", "1700-0", 0) and split_key("1700-0") == (None, "1700-0", 0)
    streams = BatchStreams(KEYS, "m", ["sql", "chat.v2"])
    assert streams.all() == [KEYS.batches("m"), KEYS.batches("m:sql"), KEYS.batches("m:chat.v2")]
    assert streams.key(KEYS.batches("m:sql").encode(), b"5-0") == "sql/5-0"
    assert streams.key(KEYS.batches("m"), "5-0") == "5-0"
    assert streams.stream_of("chat.v2/5-0") == KEYS.batches("m:chat.v2")
    assert streams.by_stream(["1-0", "sql/1-0", "2-0", "sql/3-0"]) == {
        KEYS.batches("m"): ["1-0", "2-0"], KEYS.batches("m:sql"): ["1-0", "3-0"]}
    assert streams.model_of(None) == "m" and streams.model_of("sql") == "m:sql"
    with pytest.raises(ValueError, match="not one of this worker's batch streams"):
        streams.adapter_of(KEYS.batches("m:other"))
    with pytest.raises(ValueError, match="adapters"):
        BatchStreams(KEYS, "m", ["a/b"])


def test_streams_to_read_prefers_the_worker_that_has_the_adapter_loaded():
    adapters = ["a", "b", "c"]
    elsewhere = {"b": {"w2"}, "c": set()}
    # busy: the base, what is loaded here, and what is loaded nowhere; not b (w2 has it loaded)
    assert streams_to_read(adapters, {"a"}, elsewhere, idle=False) == [None, "a", "c"]
    assert streams_to_read(adapters, {"b"}, elsewhere, idle=False) == [None, "a", "b", "c"]
    # idle: everything (capacity must not sit unused while b waits for a busy w2)
    assert streams_to_read(adapters, set(), elsewhere, idle=True) == [None, "a", "b", "c"]
    assert streams_to_read(adapters, set(), {n: {"w2"} for n in adapters}, idle=False) == [None]
    assert streams_to_read([], set(), {}, idle=False) == [None]


# -- the echo engine's adapters ----------------------------------------------------------------------


def _echo_text(engine: EchoEngine, rid: str, lora: str | None) -> str:
    engine.add_request(rid, prompt="hi", sampling_params={"max_tokens": 2}, lora=lora)
    (out,) = [o for o in engine.step() if o.request_id == rid]
    return out.outputs[0].text


def test_echo_engine_marks_the_adapter_and_refuses_one_it_does_not_serve():
    engine = EchoEngine(adapters=["b", "a"])
    assert engine.lora_adapters() == ["a", "b"] and engine.resident_adapters() == ["a", "b"]
    assert _echo_text(engine, "r1", "a") == adapter_marker("a") + "hi" == "[a] hi"
    assert _echo_text(engine, "r2", None) == "hi"
    with pytest.raises(ValueError, match="adapter 'z' is not served by this engine; it serves: a, b"):
        engine.add_request("r3", prompt="hi", lora="z")
    with pytest.raises(ValueError, match="serves: none"):
        EchoEngine().add_request("r4", prompt="hi", lora="a")
    lru = EchoEngine(adapters=["a", "b", "c"], max_loras=2)
    assert lru.resident_adapters() == []
    for rid, name in enumerate(["a", "b", "a", "c"]):
        _echo_text(lru, str(rid), name)
    assert lru.resident_adapters() == ["a", "c"]  # b was used least recently


# -- the CLI flags -----------------------------------------------------------------------------------


def test_lora_flags_become_engine_settings_and_bad_ones_are_usage_errors(tmp_path):
    (tmp_path / "sql").mkdir()
    modules = parse_lora_modules([f"sql={tmp_path / 'sql'}"])
    assert modules == {"sql": str((tmp_path / "sql").resolve())}
    assert lora_options(modules, 2, 8, 16, echo=False) == {
        "lora_modules": modules, "max_loras": 2, "max_cpu_loras": 8, "max_lora_rank": 16}
    assert lora_options(modules, 1, None, None, echo=True) == {"adapters": ["sql"], "max_loras": 1}
    assert lora_options({}, None, None, None, echo=False) == {}
    from batchinfer.workers.engine_config import EngineConfig  # what build_engine passes them to

    config = EngineConfig(model=str(tmp_path), **lora_options(modules, 2, 8, 16, echo=False))
    assert config.lora_modules == modules and (config.max_loras, config.max_cpu_loras) == (2, 8)
    runner = CliRunner()
    for args, why in ((["--lora", "sql"], "use NAME=DIR"),
                      (["--lora", f"a:b={tmp_path / 'sql'}"], "an adapter name is"),
                      (["--lora", f"sql={tmp_path / 'missing'}"], "is not a folder"),
                      (["--lora", f"sql={tmp_path / 'sql'}", "--lora", f"sql={tmp_path}"], "given twice")):
        result = runner.invoke(cli, ["worker", "--echo", *args])
        assert result.exit_code == 2 and "--lora" in result.output and why in result.output, result.output
    result = runner.invoke(cli, ["worker", "--echo", "--lora", f"sql={tmp_path / 'sql'}",
                                 "--max-lora-rank", "8"])
    assert result.exit_code == 2 and "--max-lora-rank" in result.output, result.output
    lines = tmp_path / "in.jsonl"
    lines.write_text('{"prompt": "x"}\n')
    result = runner.invoke(cli, ["run", str(lines), "-o", str(tmp_path / "o.jsonl"), "--echo",
                                 "--model", "tiny", "--lora", "bad"])
    assert result.exit_code == 2 and "--lora" in result.output, result.output  # before anything starts


# -- one worker, several streams (threaded daemons, batches written by hand) -------------------------


def _settings(**kw) -> Settings:
    return Settings(prefix=PREFIX, heartbeat_seconds=kw.pop("heartbeat_seconds", 0.3), **kw)


def _request(job: str, idx: int, lora: str | None = None) -> BatchRequest:
    model = "echo" if lora is None else f"echo:{lora}"
    return BatchRequest(request_id=f"{job}:{idx}", job_id=job, idx=idx, prompt_token_ids=[65 + idx % 26, 66],
                        sampling_params={"max_tokens": 2, "temperature": 0.0}, model=model, line=idx + 1,
                        custom_id=f"c{idx}", created_at=1, lora=lora)


def _dispatch(r, requests: list[BatchRequest], lora: str | None = None, entry_id: str = "*") -> str:
    """What the scheduler does: one batch entry on the model's, or the adapter model's, stream."""
    stream = KEYS.batches("echo" if lora is None else f"echo:{lora}")
    if not r.exists(stream):
        r.xgroup_create(stream, WORKERS_GROUP, id="0", mkstream=True)
    fields = {"v": "1", "requests": json.dumps([q.to_dict() for q in requests])}
    return r.xadd(stream, fields, id=entry_id).decode()


def _job(r, job: str, batches: list[tuple[str | None, int]]) -> list[BatchRequest]:
    """A job of batches ``(adapter or None, size)``, dispatched; its requests."""
    JobStore(r, KEYS).create(job, model="echo")
    reqs: list[BatchRequest] = []
    for lora, size in batches:
        part = [_request(job, len(reqs) + i, lora) for i in range(size)]
        _dispatch(r, part, lora)
        reqs += part
    Publisher(r, KEYS).finish_submission(job, len(reqs))
    return reqs


def _rows(r, job: str) -> dict[int, dict]:
    return {row["idx"]: row for row in (json.loads(f[b"row"]) for _, f in r.xrange(KEYS.results(job)))}


def Running(r, engine, name="w1", settings=None, **kw) -> ThreadedWorker:  # noqa: N802 - reads as a class
    return ThreadedWorker(worker_daemon(r, settings or _settings(), engine, name, **kw))


def test_one_worker_answers_the_base_and_each_adapter_from_its_own_stream(redis_server):
    r = redis_server.client()
    reqs = _job(r, "j1", [(None, 3), ("a", 2), ("b", 3), ("a", 1), (None, 1)])
    worker = Running(r, EchoEngine(adapters=["a", "b"], requests_per_step=2, max_num_seqs=4),
                     served_model_names=["echo", "e2"])
    wait_until(lambda: len(_rows(r, "j1")) == len(reqs), what="every row")
    rows = _rows(r, "j1")
    for idx, q in enumerate(reqs):
        row = rows[idx]
        assert row["status"] == "completed", row
        marker = adapter_marker(q.lora) if q.lora else ""
        assert row["output_text"] == marker + chr(65 + idx % 26) + "B", (q.lora, row["output_text"])
    for model in ("echo", "echo:a", "echo:b"):  # every batch acked and deleted on its own stream
        stream = KEYS.batches(model)

        def acked(s: str = stream) -> bool:
            return r.xlen(s) == 0

        wait_until(acked, what=f"{model}'s batches acked")
        assert r.xpending(KEYS.batches(model), WORKERS_GROUP)["pending"] == 0
    registry = Registry(r, KEYS)
    assert registry.models() == ["echo", "echo:a", "echo:b"]
    info = registry.get_model("echo:a")
    assert info is not None and info.adapter == "a" and info.base_model == "echo"
    base = registry.get_model("echo")
    assert base is not None and info.files == base.files  # the base's tokenizer
    assert registry.aliases() == {"e2": "echo", "a": "echo:a", "e2:a": "echo:a", "b": "echo:b",
                                  "e2:b": "echo:b"}
    (me,) = registry.live_workers("echo")
    assert me.info["adapters"] == ["a", "b"] and me.info["adapter_models"] == ["echo:a", "echo:b"]
    assert me.info["loras_resident"] == ["a", "b"]
    assert [w.name for w in registry.live_workers("echo:b")] == ["w1"]  # the scheduler's routing
    assert worker.stop() == 0


def test_a_base_worker_reads_one_stream_and_reports_no_adapters(redis_server):
    r = redis_server.client()
    reqs = _job(r, "j0", [(None, 2)])
    _dispatch(r, [_request("j0x", 0, "a")], "a")  # an adapter's batch: not this worker's
    worker = Running(r, EchoEngine())
    wait_until(lambda: len(_rows(r, "j0")) == len(reqs), what="the base rows")
    (me,) = Registry(r, KEYS).live_workers("echo")
    assert (me.info["adapters"], me.info["adapter_models"], me.info["loras_resident"]) == ([], [], [])
    assert worker.stop() == 0
    assert r.xlen(KEYS.batches("echo:a")) == 1
    assert r.xpending(KEYS.batches("echo:a"), WORKERS_GROUP)["pending"] == 0


def test_equal_entry_ids_on_two_streams_and_pending_entries_of_every_stream_come_back(redis_server):
    """Entry ids of the base and an adapter stream can be equal: keyed apart, both run and both are
    acked on their own stream; entries this worker held before a restart (pending) are run again."""
    r = redis_server.client()
    JobStore(r, KEYS).create("j2", model="echo")
    base, lora = [_request("j2", 0), _request("j2", 1)], [_request("j2", 2, "a"), _request("j2", 3, "a")]
    assert _dispatch(r, base, entry_id="5-0") == _dispatch(r, lora, "a", entry_id="5-0") == "5-0"
    _dispatch(r, [_request("j2", 4, "a")], "a", entry_id="6-0")
    Publisher(r, KEYS).finish_submission("j2", 5)
    for stream in (KEYS.batches("echo"), KEYS.batches("echo:a")):  # "w1" took them, then died
        r.xreadgroup(WORKERS_GROUP, "w1", {stream: ">"}, count=1)
    assert r.xpending(KEYS.batches("echo:a"), WORKERS_GROUP)["pending"] == 1
    worker = Running(r, EchoEngine(adapters=["a"]))
    wait_until(lambda: len(_rows(r, "j2")) == 5, what="5 rows")
    assert worker.stop() == 0
    rows = _rows(r, "j2")
    assert [rows[i]["output_text"].startswith("[a] ") for i in range(5)] == [False, False, True, True, True]
    assert r.xlen(KEYS.batches("echo")) == 0 and r.xlen(KEYS.batches("echo:a")) == 0


def test_keeper_refreshes_each_lease_on_its_own_stream(redis_server):
    r = redis_server.client()
    streams = BatchStreams(KEYS, "m", ["a"])
    ids = {}
    for lora, stream in ((None, KEYS.batches("m")), ("a", KEYS.batches("m:a"))):
        r.xgroup_create(stream, WORKERS_GROUP, id="0", mkstream=True)
        ids[lora] = [r.xadd(stream, {"n": i}, id=f"{i + 1}-0").decode() for i in range(2)]  # equal ids
        r.xreadgroup(WORKERS_GROUP, "w1", {stream: ">"})
    keeper = Keeper(r, KEYS, worker="w1", model="m", lease_seconds=30, heartbeat_seconds=10,
                    status=lambda: {"model": "m"}, streams=streams)
    for lora, entries in ids.items():
        for eid in entries:
            keeper.hold(entry_key(lora, eid))
    r.xclaim(KEYS.batches("m:a"), WORKERS_GROUP, "scheduler", 0, ["2-0"])  # the adapter's 2-0 only
    wait_until(lambda: all(e["time_since_delivered"] >= 50 for s in ("m", "m:a")
                           for e in r.xpending_range(KEYS.batches(s), WORKERS_GROUP, "-", "+", 10, "w1")),
               what="the leases to age")
    keeper.refresh()
    assert keeper.take_lost() == ["a/2-0"]  # the base's 2-0 is still this worker's
    for s, kept in (("m", ["1-0", "2-0"]), ("m:a", ["1-0"])):
        pending = r.xpending_range(KEYS.batches(s), WORKERS_GROUP, "-", "+", 10, consumername="w1")
        assert [p["message_id"].decode() for p in pending] == kept
        assert all(p["time_since_delivered"] < 50 for p in pending), pending  # refreshed just now


def test_a_retry_goes_back_to_its_adapters_stream(redis_server):
    r = redis_server.client()
    streams = BatchStreams(KEYS, "echo", ["a"])
    for stream in streams.all():
        r.xgroup_create(stream, WORKERS_GROUP, id="0", mkstream=True)
    outbox = Outbox(r, KEYS, streams, Publisher(r, KEYS), enqueue_export=lambda job: None,
                    on_published=lambda rows: None, on_acked=lambda keys: None, max_attempts=3)
    outbox.retry(_request("j3", 0, "a"))
    outbox.retry(_request("j3", 1))
    outbox.flush(Book())
    ((_, on_a),) = r.xrange(KEYS.batches("echo:a"))
    ((_, on_base),) = r.xrange(KEYS.batches("echo"))
    retried = json.loads(on_a[b"requests"])
    assert [(q["request_id"], q["lora"], q["attempts"]) for q in retried] == [("j3:0", "a", 1)]
    assert [q["request_id"] for q in json.loads(on_base[b"requests"])] == ["j3:1"]


def test_an_adapter_request_the_engine_failed_on_is_retried_on_the_adapters_stream(redis_server):
    r = redis_server.client()
    failed: set[str] = set()

    def fail_once(rid: str) -> None:
        if rid == "j4:1" and rid not in failed:
            failed.add(rid)
            raise RuntimeError("flaky device")

    reqs = _job(r, "j4", [("a", 2)])
    first = r.xinfo_stream(KEYS.batches("echo:a"))["last-generated-id"]
    worker = Running(r, FaultyEchoEngine(adapters=["a"], fault_hook=fail_once))
    wait_until(lambda: len(_rows(r, "j4")) == len(reqs), what="both rows")
    assert worker.stop() == 0
    rows = _rows(r, "j4")
    assert rows[1]["status"] == "completed" and rows[1]["output_text"].startswith("[a] ")
    assert r.hgetall(KEYS.attempts("j4")) == {b"1": b"1"}
    assert r.xinfo_stream(KEYS.batches("echo:a"))["last-generated-id"] > first  # the retry's entry
    assert not r.exists(KEYS.batches("echo")) or r.xinfo_stream(KEYS.batches("echo"))["entries-added"] == 0


def test_busy_worker_leaves_an_adapter_loaded_elsewhere_to_that_worker_until_it_is_idle(redis_server):
    """Cache affinity: while w1 runs base requests, it does not read the stream of adapter b, which
    live worker w2 has loaded; once idle, it takes b's batch (nobody else took it)."""
    r = redis_server.client()
    registry = Registry(r, KEYS)
    registry.heartbeat_worker("w2", {"model": "echo", "adapters": ["b"], "adapter_models": ["echo:b"],
                                     "loras_resident": ["b"]}, ttl=60)
    registry.heartbeat_worker("w3", {"model": "other", "loras_resident": ["a"]}, ttl=60)  # another base
    engine = EchoEngine(adapters=["a", "b"], max_loras=1, step_delay=0.05, requests_per_step=1,
                        max_num_seqs=8)
    daemon = worker_daemon(r, _settings(), engine, "w1")
    daemon.keeper.heartbeat()
    assert daemon.keeper.resident_elsewhere() == {"b": frozenset({"w2"})}
    assert daemon.reader.streams_now(idle=False) == [KEYS.batches("echo"), KEYS.batches("echo:a")]
    assert daemon.reader.streams_now(idle=True) == daemon.streams.all()
    reqs = _job(r, "j5", [(None, 8)])
    worker = ThreadedWorker(daemon)
    wait_until(lambda: daemon.book.running, what="w1 busy with the base batch")
    _dispatch(r, [_request("j5b", 0, "b")], "b")
    JobStore(r, KEYS).create("j5b", model="echo")
    Publisher(r, KEYS).finish_submission("j5b", 1)
    while len(_rows(r, "j5")) < len(reqs) - 1:  # busy: b's batch stays undelivered
        assert r.xpending(KEYS.batches("echo:b"), WORKERS_GROUP)["pending"] == 0
        time.sleep(0.01)
    wait_until(lambda: _rows(r, "j5b"), what="b's row once w1 is idle")
    assert _rows(r, "j5b")[0]["output_text"].startswith("[b] ") and _rows(r, "j5b")[0]["worker"] == "w1"
    assert worker.stop() == 0


def test_an_adapter_alias_a_live_worker_of_another_model_serves_is_skipped(redis_server, caplog):
    r = redis_server.client()
    registry = Registry(r, KEYS)
    registry.heartbeat_worker("w9", {"model": "other", "served_model_names": ["other", "a"]}, ttl=60)
    caplog.set_level(logging.WARNING, logger="batchinfer.workers.service.registration")
    worker = Running(r, EchoEngine(adapters=["a"]), served_model_names=["echo", "e2"])
    wait_until(lambda: registry.live_workers("echo"), what="w1 live")
    assert worker.stop() == 0
    assert registry.aliases() == {"e2": "echo", "e2:a": "echo:a"}  # no "a": w9's
    assert "not serving adapter 'a' as 'a'" in caplog.text and "w9" in caplog.text


# -- the real daemons ----------------------------------------------------------------------------------


def _echo_worker(stack: Stack, name: str, adapters: str, tmp: Path) -> None:
    folders = []
    for a in adapters:
        (tmp / a).mkdir(exist_ok=True)  # the echo engine serves the names without reading them
        folders += ["--lora", f"{a}={tmp / a}"]
    stack.start(name, "worker", "--name", name, "--device", "cpu", "--echo", "--engine-option",
                "step_delay=0.05", "--engine-option", "requests_per_step=2", "--engine-option",
                "max_num_seqs=4", *folders)


def _lines(models: dict[str, str | None], n: int) -> tuple[list[dict], dict[str, str | None]]:
    lines, want = [], {}
    for model, lora in models.items():
        for i in range(n):
            cid = f"{model}-{i}"
            lines.append({"custom_id": cid, "model": model, "prompt": f"p{i}", "max_tokens": 2})
            want[cid] = lora
    return lines, want


@pytest.fixture
def stack(redis_server, tmp_path):
    s = Stack(redis_server.url, tmp_path, env=FAULT_ENV)
    yield s
    s.close()


def test_two_workers_with_different_adapters_answer_each_line_with_its_adapter(stack, tmp_path):
    stack.start("scheduler", "scheduler")
    stack.start("exporter", "exporter")
    _echo_worker(stack, "w-ab", "ab", tmp_path)
    _echo_worker(stack, "w-bc", "bc", tmp_path)
    stack.wait_for_workers(2)
    lines, want = _lines({"a": "a", "echo:b": "b", "c": "c", "echo": None}, 4)
    job = stack.client.submit(lines)  # no job model: each line names its own
    record = stack.wait(job)
    rows = assert_exactly_once(stack, job, len(lines), record)
    for row in rows:
        lora = want[row["custom_id"]]
        assert row["status"] == "completed", (row, stack.logs())
        assert row["output_text"].startswith(adapter_marker(lora)) if lora else "[" not in row["output_text"]
        if lora == "a":
            assert row["worker"] == "w-ab", row
        if lora == "c":
            assert row["worker"] == "w-bc", row


def test_a_killed_workers_adapter_batch_is_answered_by_another_worker_serving_the_adapter(stack, tmp_path):
    stack.start("scheduler", "scheduler")
    stack.start("exporter", "exporter")
    _echo_worker(stack, "w1", "a", tmp_path)
    _echo_worker(stack, "w2", "a", tmp_path)
    stack.wait_for_workers(2)
    lines, _ = _lines({"a": "a"}, 16)
    job = stack.client.submit(lines)
    holder = stack.until(lambda: next((w for w in ("w1", "w2") if pending_of(stack, "echo:a", w)), None),
                         30, "a worker holding an adapter batch", poll=0.01)
    stack.kill(holder)
    record = stack.wait(job)
    rows = assert_exactly_once(stack, job, len(lines), record)
    assert all(r["status"] == "completed" and r["output_text"].startswith("[a] ") for r in rows), rows
    other = {"w1": "w2", "w2": "w1"}[holder]
    assert any(r["worker"] == other for r in rows)
    assert pending_of(stack, "echo:a", holder) == []  # its batches were taken back


def test_a_bad_adapter_folder_ends_the_worker_at_start_naming_the_flag(tiny_llama, tmp_path):
    from batchinfer.cli.context import EXIT_STARTUP

    (tmp_path / "empty").mkdir()
    result = CliRunner().invoke(cli, ["worker", "--model", str(tiny_llama), "--device", "cpu",
                                      "--lora", f"sql={tmp_path / 'empty'}", "--redis-url", "redis://127.0.0.1:1/0"])
    assert result.exit_code == EXIT_STARTUP, result.output
    assert "lora adapter 'sql'" in result.output and "check --lora NAME=DIR" in result.output, result.output
