"""Issue 28, items 2 and 5: where ``run`` runs, and the flags ``run`` and ``submit`` share.

``BATCHINFER_REDIS_URL`` exported for a deployment's daemons must not move ``run`` onto that Redis
(a second scheduler and worker beside production's, unannounced): only ``--redis-url`` on its
command line does, and one line says which Redis it uses. A missing input file exits 7 from
``run`` as from ``submit``; ``submit`` takes ``-o`` as ``run`` and ``results`` do.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from pathlib import Path

import pytest
from cli_helpers import invoke, prompts
from daemons import CLI, START_TIMEOUT_S

from batchinfer.cli import context as cli_context
from batchinfer.client.client import Client
from batchinfer.config import Settings
from batchinfer.redis_conn import connect

RUN_TIMEOUT_S = START_TIMEOUT_S + 120


def _run(tmp_path: Path, model: Path, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess:
    out = tmp_path / f"out-{uuid.uuid4().hex[:6]}.jsonl"
    return subprocess.run([*CLI, "run", str(prompts(tmp_path)), "-o", str(out), "--echo",
                           "--model", str(model), "--progress-every", "0", *extra],
                          env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=tmp_path)


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHINFER_")}
    return {**env, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **extra}


@pytest.mark.slow
def test_the_environment_url_does_not_move_run(tiny_llama, tmp_path, redis_session):
    prefix = f"{{r{uuid.uuid4().hex[:8]}}}"
    env = _clean_env(BATCHINFER_REDIS_URL=redis_session.url, BATCHINFER_PREFIX=prefix)
    proc = _run(tmp_path, tiny_llama, env)
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stderr.splitlines() if x.startswith("redis: "))
    assert line.startswith("redis: embedded redis-server on unix://"), line
    assert f"BATCHINFER_REDIS_URL={redis_session.url} is not used by run" in line, line
    with connect(redis_session.url) as r:  # the shared Redis saw no job, no worker, no scheduler
        assert list(r.scan_iter(match=f"{prefix}*")) == []


@pytest.mark.slow
def test_redis_url_on_the_command_line_is_used_and_named(tiny_llama, tmp_path, redis_session):
    prefix = f"{{r{uuid.uuid4().hex[:8]}}}"
    proc = _run(tmp_path, tiny_llama, _clean_env(BATCHINFER_PREFIX=prefix), "--redis-url", redis_session.url)
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stderr.splitlines() if x.startswith("redis: "))
    assert line == f"redis: {redis_session.url} (--redis-url)", line
    with Client(settings=Settings(redis_url=redis_session.url, prefix=prefix)) as client:
        [record] = client.jobs()
        assert record.status.value == "completed" and record.total == 3


def test_a_missing_input_file_exits_7_from_run_and_submit(tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    out = str(tmp_path / "o.jsonl")
    ran = invoke("run", missing, "-o", out, "--echo", code=cli_context.EXIT_INPUT)
    assert f"{missing}: no such file" in ran.output and not Path(out).exists()
    # submit reads the file before it needs Redis: nothing listens on port 1
    submitted = invoke("--redis-url", "redis://127.0.0.1:1/0", "submit", missing, code=cli_context.EXIT_INPUT)
    assert f"{missing}: no such file" in submitted.output
    # a folder is a dataset for both (issue 31): an empty one is refused before anything starts
    empty = tmp_path / "empty"
    empty.mkdir()
    for command in (["run", str(empty), "-o", out, "--echo"],
                    ["--redis-url", "redis://127.0.0.1:1/0", "submit", str(empty)]):
        folder = invoke(*command, code=cli_context.EXIT_INPUT)
        assert f"{empty} holds no file" in folder.output and not Path(out).exists()


def test_submit_takes_o_as_output(tmp_path, redis_session, monkeypatch):
    prefix = f"{{o{uuid.uuid4().hex[:8]}}}"
    root = tmp_path / "results"
    root.mkdir()
    monkeypatch.setenv("BATCHINFER_RESULTS_ROOT", str(root))
    result = invoke("--redis-url", redis_session.url, "--prefix", prefix, "submit",
                    str(prompts(tmp_path)), "-o", "mine.parquet", "--json")
    job = json.loads(result.output)["job_id"]
    with Client(settings=Settings(redis_url=redis_session.url, prefix=prefix)) as client:
        assert client.status(job).output.endswith("mine.parquet")
