"""OpenAI's two files (``--error-file``): completed rows in the output file, the others in the error
file, in every format; and the Parquet ``tool_calls`` column, which round-trips."""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from pathlib import Path

import cli_helpers
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from daemons import CLI, JOB_TIMEOUT_S
from output_lines import CHAT, TIME, WEATHER, completed, failed, output

from batchinfer.cli import context as cli_context
from batchinfer.client.client import Client
from batchinfer.config import Settings
from batchinfer.jobs.formats import RESULT_SCHEMA, TOOL_CALL_TYPE, protocol_row, result_schema
from batchinfer.jobs.openai_lines import openai_line
from batchinfer.jobs.output import write_rows
from batchinfer.protocol.rows import ResultRow
from batchinfer.store.jobstore import JobStore, openai_batch
from batchinfer.store.publish import Publisher


def _rows() -> list[dict]:
    """Five rows in input order: completed, failed, completed (with calls), cancelled, expired."""
    return [{**completed(CHAT, request_id="j:0"), "idx": 0, "custom_id": "c0"},
            {**failed(), "request_id": "j:1", "idx": 1, "custom_id": "c1"},
            {**completed(CHAT, output(text="", finish="tool_calls", calls=[WEATHER]), request_id="j:2"),
             "idx": 2, "custom_id": "c2"},
            {**failed("cancelled", None, "the job was cancelled"), "request_id": "j:3", "idx": 3,
             "custom_id": "c3"},
            {**failed("expired", None, "the job expired"), "request_id": "j:4", "idx": 4, "custom_id": "c4"}]


def _custom_ids(path: Path, fmt: str) -> list[str]:
    if fmt == "parquet":
        return pq.read_table(path).column("custom_id").to_pylist()
    return [json.loads(x)["custom_id"] for x in path.read_text().splitlines()]


@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "openai", "anthropic"])
def test_error_rows_go_to_the_error_file(tmp_path, fmt):
    out, err = tmp_path / f"out.{fmt}", tmp_path / f"err.{fmt}"
    assert write_rows(_rows(), str(out), fmt, errors=str(err)) == str(out)
    assert _custom_ids(out, fmt) == ["c0", "c2"]
    assert _custom_ids(err, fmt) == ["c1", "c3", "c4"]
    if fmt == "parquet":  # the error file has the output's schema
        assert pq.read_schema(out).equals(RESULT_SCHEMA) and pq.read_schema(err).equals(RESULT_SCHEMA)
    if fmt == "openai":
        assert all(json.loads(x)["error"] is None for x in out.read_text().splitlines())
        assert [json.loads(x)["error"]["code"] for x in err.read_text().splitlines()] == [
            "invalid_request", "batch_cancelled", "batch_expired"]
    # without an error file: one file with every row, as before
    every = tmp_path / f"every.{fmt}"
    write_rows(_rows(), str(every), fmt)
    assert _custom_ids(every, fmt) == ["c0", "c1", "c2", "c3", "c4"]


def test_no_error_rows_still_writes_an_empty_error_file(tmp_path):
    rows = [r for r in _rows() if r["status"] == "completed"]
    write_rows(rows, str(tmp_path / "o.jsonl"), "openai", errors=str(tmp_path / "e.jsonl"))
    assert (tmp_path / "e.jsonl").read_text() == ""
    write_rows(rows, str(tmp_path / "o.parquet"), errors=str(tmp_path / "e.parquet"))
    empty = pq.read_table(tmp_path / "e.parquet")
    assert empty.num_rows == 0 and empty.schema.equals(RESULT_SCHEMA)


def test_a_failed_write_leaves_neither_file(tmp_path):
    bad = {**_rows()[1], "idx": "not a number"}  # fails the Parquet schema
    with pytest.raises(ValueError, match="does not fit the result schema"):
        write_rows([*_rows(), bad], str(tmp_path / "o.parquet"), errors=str(tmp_path / "e.parquet"),
                   row_group_rows=2)
    assert os.listdir(tmp_path) == []  # no file, no temporary left behind


def test_tool_calls_column_round_trips(tmp_path):
    # appended, as each later column: the older columns keep their places
    later = ["tool_calls", "accepted_prediction_tokens", "rejected_prediction_tokens"]
    assert RESULT_SCHEMA.names[-3:] == later
    assert RESULT_SCHEMA.field("tool_calls").type == pa.list_(TOOL_CALL_TYPE)
    assert result_schema(pa.list_(pa.float32())).names.index("tool_calls") == len(RESULT_SCHEMA) - 3
    calls = completed(CHAT, output(text="", finish="tool_calls", calls=[WEATHER, TIME]))
    path = write_rows([calls, completed(CHAT, request_id="job-1:1"), failed()], str(tmp_path / "r.parquet"))
    back = [protocol_row(r) for r in pq.read_table(path).to_pylist()]
    assert [r["tool_calls"] for r in back] == [[WEATHER, TIME], None, None]
    # the first completion of a row read back takes the column's calls (its struct has none of its own)
    message = json.loads(openai_line(back[0] | {"url": CHAT}))["response"]["body"]["choices"][0]["message"]
    assert message["tool_calls"] == [WEATHER, TIME] and message["content"] is None


def test_openai_batch_names_no_error_file(redis_server):
    from batchinfer.keys import Keys

    keys = Keys("{ef}")
    store = JobStore(redis_server.client(), keys)
    store.create("b1")
    redis_server.client().hset(keys.job("b1"), mapping={"failed": 2, "completed": 1, "status": "completed",
                                                        "output": "/x/out.jsonl", "exported_at": 1})
    batch = openai_batch(store.get("b1"))
    # the job's file holds the error lines too: naming it twice would have them read twice
    assert batch["output_file_id"] == "/x/out.jsonl" and batch["error_file_id"] is None


# -- the command line ------------------------------------------------------------------------------


@pytest.fixture
def env(redis_session):
    prefix = f"{{e{uuid.uuid4().hex[:8]}}}"
    args = ["--redis-url", redis_session.url, "--prefix", prefix, "--log-level", "WARNING"]
    client = Client(settings=Settings(redis_url=redis_session.url, prefix=prefix))
    yield args, client
    client.close()


def test_results_error_file(env, tmp_path):
    args, client = env
    job = client.submit(cli_helpers.prompts(tmp_path, 3))
    publisher = Publisher(client.redis, client.keys)
    publisher.publish(ResultRow(job_id=job, request_id=f"{job}:0", idx=0, status="completed", custom_id="c0",
                                output_text="o0", finished_at=1))
    publisher.publish(ResultRow.error("invalid_request", "bad", job_id=job, idx=1, custom_id="c1", line=2))
    publisher.publish(ResultRow.error("cancelled", "cancelled", status="cancelled", job_id=job, idx=2,
                                      custom_id="c2"))
    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    data = json.loads(cli_helpers.invoke(*args, "results", job, "-o", str(out), "--format", "anthropic",
                                         "--error-file", str(err), "--json").stdout)
    assert data == {"job_id": job, "output": str(out), "format": "anthropic", "error_file": str(err)}
    assert [json.loads(x)["result"]["type"] for x in out.read_text().splitlines()] == ["succeeded"]
    assert [json.loads(x)["result"]["type"] for x in err.read_text().splitlines()] == ["errored", "canceled"]
    # an existing error file is kept without --force; the output itself is no error file
    again = cli_helpers.invoke(*args, "results", job, "-o", str(tmp_path / "o2.jsonl"), "--error-file",
                               str(err), code=cli_context.EXIT_USAGE)
    assert "--force" in again.output
    same = cli_helpers.invoke(*args, "results", job, "-o", str(tmp_path / "o3.jsonl"), "--error-file",
                              str(tmp_path / "o3.jsonl"), code=2)
    assert "must not be OUTPUT" in same.output
    cli_helpers.invoke(*args, "results", job, "-o", str(tmp_path / "o.parquet"), "--error-file",
                       str(err), "--force")
    assert pq.read_table(err).column("custom_id").to_pylist() == ["c1", "c2"]  # OUTPUT's format


@pytest.mark.slow
def test_run_error_file_end_to_end(tiny_llama, tmp_path):
    lines = [{"custom_id": "good-1", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}},
             "{not json",
             {"custom_id": "bad-temp", "method": "POST", "url": "/v1/completions",
              "body": {"model": "m", "prompt": "x", "temperature": -1}},
             {"custom_id": "good-2", "method": "POST", "url": "/v1/completions",
              "body": {"model": "m", "prompt": "Hello", "max_tokens": 3}}]
    f = tmp_path / "in.jsonl"
    f.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("BATCHINFER_REDIS_URL", None)
    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    proc = subprocess.run([*CLI, "run", str(f), "-o", str(out), "--format", "openai",
                           "--error-file", str(err), "--model", str(tiny_llama), "--logs",
                           str(tmp_path / "logs"), "--json"],
                          env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S, cwd=tmp_path)
    logs = "\n".join(p.read_text() for p in (tmp_path / "logs").glob("*.log"))
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n{logs}"
    good = [json.loads(x) for x in out.read_text().splitlines()]
    bad = [json.loads(x) for x in err.read_text().splitlines()]
    assert [g["custom_id"] for g in good] == ["good-1", "good-2"]
    assert [g["response"]["body"]["object"] for g in good] == ["chat.completion", "text_completion"]
    assert [b["custom_id"] for b in bad] == [None, "bad-temp"]
    assert [b["error"]["code"] for b in bad] == ["invalid_json", "invalid_request"]
    assert all(":" not in g["id"] for g in good + bad)
    # the job's exporter wrote both files (the job's error_output), not `run` afterwards
    record = json.loads(proc.stdout)
    assert record["error_output"] == err.resolve().as_uri() and record["exported_at"] is not None
    assert record["output"] == out.resolve().as_uri()
