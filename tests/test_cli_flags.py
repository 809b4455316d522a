"""The CLI a person runs (issue 11): global flags after the command, result files named by their
extension and never overwritten silently, requests held for an unserved model shown everywhere,
the overridden-model note, one-line start-up errors of the daemons, and the exporter's log."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import cli_helpers
import pyarrow.parquet as pq
import pytest
from cli_helpers import invoke
from daemons import CLI, Stack

from batchinfer.cli import context as cli_context
from batchinfer.client.client import Client
from batchinfer.config import Settings
from batchinfer.jobs.exporter import QuietMaintenance
from batchinfer.protocol.rows import ResultRow
from batchinfer.store.jobstore import JobField, JobStatus
from batchinfer.store.publish import Publisher
from batchinfer.store.registry import Registry


@pytest.fixture
def queue(redis_session):
    prefix = f"{{f{uuid.uuid4().hex[:8]}}}"
    client = Client(settings=Settings(redis_url=redis_session.url, prefix=prefix))
    yield redis_session.url, prefix, client
    client.close()


def prompts(tmp_path: Path, n: int = 2) -> Path:
    return cli_helpers.prompts(tmp_path, n)


# -- global flags before and after the command --------------------------------------------------


def test_global_flags_are_accepted_after_the_command(queue, tmp_path):
    url, prefix, client = queue
    f = str(prompts(tmp_path))
    before = invoke("--redis-url", url, "--prefix", prefix, "--json", "-q", "submit", f).output
    after = invoke("submit", f, "--redis-url", url, "--prefix", prefix, "--json", "-q",
                   "--log-level", "WARNING", "--log-format", "json").output
    jobs = [json.loads(before)["job_id"], json.loads(after)["job_id"]]
    assert [client.status(j).id for j in jobs] == jobs  # both created on this prefix
    # a value after the command wins over the group's
    wrong = f"{{w{uuid.uuid4().hex[:8]}}}"
    status = invoke("--redis-url", url, "--prefix", wrong, "status", jobs[1], "--prefix", prefix, "--json")
    assert json.loads(status.output)["id"] == jobs[1]
    invoke("--redis-url", url, "--prefix", wrong, "status", jobs[1], code=cli_context.EXIT_NOT_FOUND)


def test_the_docs_submit_wait_q_example_parses(queue, tmp_path):
    # docs/cli.md: `batchinfer submit nightly.parquet --model M --output ... --wait -q`
    url, prefix, client = queue

    def finish_the_job() -> None:  # the scheduler's part, by hand: no daemon runs here
        deadline = time.monotonic() + 30
        while not client.jobs():
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)
        client.store.set_status(client.jobs()[0].id, JobStatus.COMPLETED)

    helper = threading.Thread(target=finish_the_job)
    helper.start()
    result = invoke("submit", str(prompts(tmp_path)), "--model", "m", "--wait", "-q", "--redis-url", url,
                    "--prefix", prefix)
    helper.join()
    job = result.output.splitlines()[0].strip()
    assert client.status(job).status is JobStatus.COMPLETED


def test_global_flags_after_a_daemon_command_reach_it(queue, tmp_path):
    url, prefix, _ = queue
    proc = subprocess.run([*CLI, "exporter", "--burst", "--redis-url", url, "--prefix", prefix, "-q"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "INFO" not in proc.stderr  # -q after the command: warnings only


# -- results -o: the format from the name, no silent overwrite ----------------------------------


def _finished_job(client: Client, tmp_path: Path) -> str:
    job = client.submit(prompts(tmp_path))
    publisher = Publisher(client.redis, client.keys)
    for idx in range(2):
        publisher.publish(ResultRow(job_id=job, request_id=f"{job}:{idx}", idx=idx, status="completed",
                                    custom_id=f"c{idx}", output_text=f"o{idx}", finished_at=1))
    return job


def test_results_format_follows_the_extension_and_force(queue, tmp_path):
    url, prefix, client = queue
    job = _finished_job(client, tmp_path)
    base = ["--redis-url", url, "--prefix", prefix]
    lines = tmp_path / "r.jsonl"
    data = json.loads(invoke(*base, "results", job, "-o", str(lines), "--json").stdout)
    assert data["format"] == "jsonl"
    assert [json.loads(line)["custom_id"] for line in lines.read_text().splitlines()] == ["c0", "c1"]
    table = tmp_path / "r.parquet"
    invoke(*base, "results", job, "-o", str(table))
    assert pq.read_table(table).column("custom_id").to_pylist() == ["c0", "c1"]
    # an existing file is kept unless --force
    lines.write_text("keep me\n")
    refused = invoke(*base, "results", job, "-o", str(lines), code=cli_context.EXIT_USAGE)
    assert "exists: pass --force" in refused.output and lines.read_text() == "keep me\n"
    invoke(*base, "results", job, "-o", str(lines), "--force", "--format", "openai")
    assert json.loads(lines.read_text().splitlines()[0])["response"]["status_code"] == 200
    # names that say no format, or a compressed one, are refused rather than guessed
    assert "cannot tell the format" in invoke(*base, "results", job, "-o", str(tmp_path / "r.out"),
                                              code=cli_context.EXIT_USAGE).output
    assert "compressed output" in invoke(*base, "results", job, "-o", str(tmp_path / "r.jsonl.gz"),
                                         code=cli_context.EXIT_USAGE).output
    invoke(*base, "results", job, "-o", str(tmp_path / "r.out"), "--format", "jsonl")


def test_run_refuses_an_existing_output_before_starting(tmp_path):
    out = tmp_path / "out.parquet"
    out.write_bytes(b"earlier results")
    result = invoke("run", str(prompts(tmp_path)), "-o", str(out), "--echo", code=cli_context.EXIT_USAGE)
    assert "exists: pass --force" in result.output and out.read_bytes() == b"earlier results"


# -- held requests and overridden model names -----------------------------------------------------


def _hold(client: Client, job: str, n: int, model: str) -> None:
    """What the scheduler writes while requests wait for ``model`` (helper A's counters)."""
    client.redis.hset(client.keys.job(job), JobField.HELD, n)
    client.redis.hincrby(client.keys.held_models, model, n)


def test_status_jobs_and_top_show_held_requests(queue, tmp_path):
    url, prefix, client = queue
    base = ["--redis-url", url, "--prefix", prefix]
    job = client.submit(prompts(tmp_path, 3), model="SmolLM2")
    _hold(client, job, 3, "SmolLM2")
    registry = Registry(client.redis, client.keys)
    for name, model in (("w1", "hf"), ("w2", "qwen")):
        registry.heartbeat_worker(name, {"model": model, "device": "cpu"}, ttl=30)
    line = "3 held: model 'SmolLM2' is not served; served: hf, qwen"
    assert line in invoke(*base, "status", job).output
    data = json.loads(invoke(*base, "status", job, "--json").output)
    assert data["request_counts"]["held"] == 3
    assert data["held"] == {"requests": 3, "model": "SmolLM2", "models": ["SmolLM2"],
                            "served": ["hf", "qwen"], "by_model": {"SmolLM2": 3}}
    jobs = invoke(*base, "jobs").output
    assert "held 3" in jobs and line in jobs
    top = invoke(*base, "top", "--once").output
    assert line in top and "3 held" in top


def test_wait_prints_one_note_for_overridden_models(queue, tmp_path):
    url, prefix, client = queue
    job = client.submit(prompts(tmp_path), model="SmolLM2")
    client.redis.hset(client.keys.job(job), mapping={JobField.MODELS_OVERRIDDEN: 400,
                                                     JobField.OVERRIDDEN_MODELS: json.dumps(["gpt-4o-mini"])})
    client.store.set_status(job, JobStatus.COMPLETED)
    out = invoke("--redis-url", url, "--prefix", prefix, "wait", job).output
    note = "note: 400 lines named another model ('gpt-4o-mini'); the job's model 'SmolLM2' answered them"
    assert out.count(note) == 1


def test_a_job_for_an_unserved_model_shows_held_end_to_end(redis_session, tmp_path):
    stack = Stack(redis_session.url, tmp_path)
    try:
        stack.start("scheduler", "scheduler")
        stack.worker("w-echo", echo=True)
        job = stack.client.submit(prompts(tmp_path, 3), model="SmolLM2")
        base = ["--redis-url", redis_session.url, "--prefix", stack.prefix]
        deadline = time.monotonic() + 60
        while stack.client.status(job).held < 3:
            assert time.monotonic() < deadline, stack.logs()
            time.sleep(0.2)
        # "served" lists live workers: on a loaded machine the echo worker's heartbeat may lapse for a
        # moment ("served: none (no live worker)"), so the full line is awaited, not read once
        want = "3 held: model 'SmolLM2' is not served; served: echo"
        while want not in (text := invoke(*base, "status", job).output):
            assert time.monotonic() < deadline, text
            time.sleep(0.2)
        waited = invoke(*base, "wait", job, "--timeout", "1", code=cli_context.EXIT_TIMEOUT)
        assert "held: model 'SmolLM2' is not served" in waited.output  # said, not an ETA
    finally:
        stack.close()


# -- daemons: start-up errors are one line and exit 9 ---------------------------------------------


def _daemon(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "--redis-url", "redis://127.0.0.1:1/0", *args], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)


def test_worker_start_up_errors_are_one_line(tmp_path):
    empty = tmp_path / "empty-model"
    empty.mkdir()
    proc = _daemon("worker", "--model", str(empty), "--device", "cpu", tmp_path=tmp_path)
    assert proc.returncode == cli_context.EXIT_STARTUP, proc.stderr
    assert "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "config.json not found" in line and "batchinfer doctor --model" in line
    debug = _daemon("worker", "--model", str(empty), "--log-level", "DEBUG", tmp_path=tmp_path)
    assert debug.returncode == cli_context.EXIT_STARTUP and "Traceback" in debug.stderr
    bad = _daemon("worker", "--echo", "--served-model-name", "a b", tmp_path=tmp_path)
    assert bad.returncode == cli_context.EXIT_STARTUP and "Traceback" not in bad.stderr


def test_worker_on_a_device_this_machine_lacks(tiny_llama, tmp_path):
    import torch

    device = f"cuda:{torch.cuda.device_count()}"  # one past the last: never there
    proc = _daemon("worker", "--model", str(tiny_llama), "--device", device, tmp_path=tmp_path)
    assert proc.returncode == cli_context.EXIT_STARTUP, proc.stderr
    assert "Traceback" not in proc.stderr and f"--device {device}" in proc.stderr
    assert "CUDA" in proc.stderr


def test_daemon_bad_options_and_a_busy_metrics_port(redis_session, tmp_path):
    for option, value in (("--lease-seconds", "-1"), ("--max-attempts", "0"), ("--metrics-port", "70000")):
        assert _daemon("scheduler", option, value, tmp_path=tmp_path).returncode == cli_context.EXIT_USAGE
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = subprocess.run([*CLI, "--redis-url", redis_session.url, "exporter", "--metrics-port",
                               str(port)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == cli_context.EXIT_STARTUP, proc.stderr
    assert "Traceback" not in proc.stderr and f"metrics port {port}" in proc.stderr


# -- the exporter's log ---------------------------------------------------------------------------


def test_rq_maintenance_lines_are_dropped_and_the_rest_kept():
    quiet = QuietMaintenance()

    def record(msg: str, level: int = logging.INFO) -> logging.LogRecord:
        return logging.LogRecord("rq.worker", level, __file__, 1, msg, ("w", "q"), None)

    root = logging.getLogger()
    previous = root.level
    root.setLevel(logging.INFO)
    try:
        assert not quiet.filter(record("Worker %s: cleaning registries for queue: %s"))
        assert not quiet.filter(record("Worker %s: cleaning group registries"))
        assert quiet.filter(record("Worker %s: started with PID %s"))
        assert quiet.filter(record("Worker %s: cleaning registries for queue: %s", logging.WARNING))
        root.setLevel(logging.DEBUG)
        assert quiet.filter(record("Worker %s: cleaning registries for queue: %s"))
    finally:
        root.setLevel(previous)


def test_exporter_log_has_no_maintenance_lines(redis_server, caplog, monkeypatch):
    # rq's own maintenance pass (what runs every MAINTENANCE_S) on the exporter's worker, in-process:
    # no waiting for the pass to come round, and no rq teardown (a burst run's can hang in rq's pubsub)
    from batchinfer.jobs import exporter

    rq_log = logging.getLogger("rq.worker")
    for f in [f for f in rq_log.filters if isinstance(f, QuietMaintenance)]:
        rq_log.removeFilter(f)
    monkeypatch.setattr(exporter, "_run", lambda settings, name, burst: 0)
    assert exporter.main(Settings(prefix="{exlog}")) == 0  # the exporter's start installs the filter
    worker = exporter.build_worker(redis_server.client(), name="exlog")

    def maintenance_lines(level: int) -> list[str]:
        caplog.clear()
        with caplog.at_level(level):
            worker.run_maintenance_tasks()  # the first pass: registries cleaned, no scheduler restart
        return [r.getMessage() for r in caplog.records if r.name == "rq.worker"]

    shown = maintenance_lines(logging.DEBUG)  # the pass ran and logged (shown again at DEBUG) ...
    assert any("cleaning registries" in m for m in shown), shown
    assert maintenance_lines(logging.INFO) == []  # ... and at INFO not one of its lines is left


def test_held_text_says_when_the_model_has_been_served_since():
    from batchinfer.cli.render import held_text

    assert held_text(3, "m", ["a"]) == "3 held: model 'm' is not served; served: a"
    assert held_text(2, None, []) == "2 held: their model is not served; served: none (no live worker)"
    # a worker registered after the requests were held: not "not served; served: m"
    assert held_text(7, "m", ["a", "m"]) == ("7 held: model 'm' is served now; the scheduler takes them "
                                             "in at its next sweep")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_the_exporter_leaves_without_sitting_out_a_pubsub_poll(redis_server):
    # redis-py 8's PubSubWorkerThread.stop() joins rq's pub/sub thread, which after the unsubscribe
    # waits out a whole poll (rq's: 60 s): the exporter's worker polls every PUBSUB_POLL_S instead.
    # Without that, `exporter --burst` hung at exit in 1 of 3 runs (test above, 60 s timeout).
    import threading

    from batchinfer.jobs.exporter import build_worker

    worker = build_worker(redis_server.client(), name="pubsub-exit")
    worker.subscribe()
    assert worker.pubsub_thread is not None and worker.pubsub_thread.is_alive()
    leaving = threading.Thread(target=worker.unsubscribe, daemon=True)
    leaving.start()
    leaving.join(timeout=20)  # a bound far above the poll, far below rq's 60 s
    assert not leaving.is_alive(), "unsubscribe still waiting for the pub/sub thread"
    assert not worker.pubsub_thread.is_alive()


def test_a_scheduler_with_another_partition_count_is_a_start_up_error(redis_server, tmp_path):
    from batchinfer.keys import Keys
    from batchinfer.store.registry import check_partitions

    check_partitions(redis_server.client(), Keys("{bi}", 2))  # the deployment runs with 2
    env = {**os.environ, "BATCHINFER_PARTITIONS": "3"}
    proc = subprocess.run([*CLI, "--redis-url", redis_server.url, "scheduler"], capture_output=True,
                          text=True, timeout=60, cwd=tmp_path, env=env)
    assert proc.returncode == cli_context.EXIT_STARTUP, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "BATCHINFER_PARTITIONS is 3 here, but this deployment ({bi}) runs with 2" in line
