"""Operability end to end: the CLI daemons' /metrics move by what a job did; health and doctor via the CLI.

Scheduler, echo worker and exporter run as ``python -m batchinfer.cli ...`` subprocesses with
``--metrics-port``; a job goes in through ``batchinfer submit --wait``; both daemons are scraped
before and after it.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from batchinfer.cli.runner import python_module
from batchinfer.client.client import Client
from batchinfer.config import Settings

from .conftest import free_port

pytestmark = pytest.mark.slow

CLI = python_module("batchinfer.cli")
START_TIMEOUT_S = 120


def http_get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:
        return 0, b""


def scrape(port: int) -> dict[str, float]:
    """Samples summed over labels other than ``model`` / ``status`` / ``code``: ``name{k=v,..}`` -> value."""
    status, body = http_get(f"http://127.0.0.1:{port}/metrics")
    assert status == 200
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            keep = {k: v for k, v in s.labels.items() if k in ("status", "code")}
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(keep.items())) + "}" if keep else "")
            out[key] = out.get(key, 0.0) + s.value
    return out


@pytest.fixture
def stack(redis_server, tmp_path):
    env = {**os.environ, "BATCHINFER_REDIS_URL": redis_server.url, "BATCHINFER_PREFIX": "{ops}",
           "BATCHINFER_RESULTS_ROOT": str(tmp_path / "results"), "BATCHINFER_HEARTBEAT_SECONDS": "1",
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    ports = {"scheduler": free_port(), "worker": free_port(), "exporter": free_port()}
    procs: dict[str, subprocess.Popen] = {}
    commands = {"scheduler": ["scheduler", "--metrics-port", str(ports["scheduler"])],
                "worker": ["worker", "--echo", "--model-name", "echo", "--name", "w0",
                           "--metrics-port", str(ports["worker"])],
                "exporter": ["exporter", "--metrics-port", str(ports["exporter"])]}
    for name, args in commands.items():
        with open(tmp_path / f"{name}.log", "ab") as log:
            procs[name] = subprocess.Popen([*CLI, "--log-format", "json", *args], env=env, cwd=tmp_path,
                                           stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    yield {"env": env, "ports": ports, "tmp": tmp_path, "url": redis_server.url}
    for proc in procs.values():
        proc.terminate()
    for name, proc in procs.items():
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        print(f"--- {name} log ---\n" + (tmp_path / f"{name}.log").read_text(errors="replace")[-4000:])


def wait_ready(port: int) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while http_get(f"http://127.0.0.1:{port}/readyz")[0] != 200:
        assert time.monotonic() < deadline, f"daemon on port {port} never became ready"
        time.sleep(0.2)


def test_metrics_move_by_what_a_job_did(stack):
    sched_port, worker_port = stack["ports"]["scheduler"], stack["ports"]["worker"]
    wait_ready(sched_port)
    wait_ready(worker_port)
    wait_ready(stack["ports"]["exporter"])  # every daemon answers /readyz, the exporter too
    assert http_get(f"http://127.0.0.1:{worker_port}/healthz") == (200, b"ok\n")
    assert b"process_resident_memory_bytes" in http_get(f"http://127.0.0.1:{stack['ports']['exporter']}/metrics")[1]
    s0, w0 = scrape(sched_port), scrape(worker_port)

    lines = [{"prompt": "hello world", "max_tokens": 4}, {"prompt": "abc", "max_tokens": 2},
             {"prompt": "metrics", "max_tokens": 3}, {"prompt": 5}, {"prompt": "last", "max_tokens": 8}]
    path = stack["tmp"] / "in.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    done = subprocess.run([*CLI, "--json", "submit", str(path), "--model", "echo", "--wait"],
                          env=stack["env"], cwd=stack["tmp"], capture_output=True, text=True, timeout=180)
    record = json.loads(done.stdout)
    assert record["request_counts"] == {"total": 5, "completed": 4, "failed": 1, "cancelled": 0, "expired": 0,
                                        "held": 0}, done.stderr
    rows = list(Client(settings=Settings(redis_url=stack["url"], prefix="{ops}")).result_rows(record["id"]))
    good = [r for r in rows if r["status"] == "completed"]

    s1, w1 = scrape(sched_port), scrape(worker_port)

    def moved(after: dict[str, float], before: dict[str, float], key: str) -> float:
        # a labelled series may start with this job; it must be there after it (KeyError otherwise)
        return after[key] - before.get(key, 0.0)

    assert moved(s1, s0, "batchinfer_requests_received_total") == 5
    assert moved(s1, s0, "batchinfer_requests_failed_total{code=invalid_request}") == 1
    assert moved(s1, s0, "batchinfer_batch_requests_sum") == 4
    dispatched = moved(s1, s0, "batchinfer_batches_dispatched_total")  # 1..4: packing depends on timing
    assert 1 <= dispatched <= 4 and moved(s1, s0, "batchinfer_batch_requests_count") == dispatched
    assert moved(w1, w0, "batchinfer_requests_completed_total") == 4
    assert moved(w1, w0, "batchinfer_generation_tokens_total") == sum(r["completion_tokens"] for r in good)
    assert moved(w1, w0, "batchinfer_prompt_tokens_total") == sum(r["prompt_tokens"] for r in good)
    assert moved(w1, w0, "batchinfer_time_to_first_token_seconds_count") == 4
    assert moved(w1, w0, "batchinfer_e2e_request_latency_seconds_count") == 4
    assert s1["batchinfer_jobs{status=completed}"] == 1 and s1["batchinfer_redis_up"] == 1
    assert s1["batchinfer_intake_lag_requests"] == 0 and s1["batchinfer_live_workers"] == 1

    # the container health check command, and JSON log lines
    probe = subprocess.run([*python_module("batchinfer.ops.httpserver"),
                            f"http://127.0.0.1:{worker_port}/readyz"], timeout=60)
    assert probe.returncode == 0
    first_line = (stack["tmp"] / "worker.log").read_text().splitlines()[0]
    assert {"ts", "level", "logger", "msg"} <= json.loads(first_line).keys()


def test_doctor_through_the_cli(redis_server, tiny_llama):
    redis_server.client().config_set("maxmemory-policy", "allkeys-lru")
    env = {**os.environ, "BATCHINFER_REDIS_URL": redis_server.url}
    doctor = subprocess.run([*CLI, "doctor", "--model", str(tiny_llama), "--device", "cpu"],
                            env=env, capture_output=True, text=True, timeout=120)
    assert doctor.returncode == 1, doctor.stdout + doctor.stderr
    assert "FAIL  redis memory policy" in doctor.stdout
    assert "fix: CONFIG SET maxmemory-policy noeviction" in doctor.stdout
    assert "PASS  model weights" in doctor.stdout and "WARN  redis aof" in doctor.stdout
