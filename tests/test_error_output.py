"""A job's ``error_output`` (OpenAI's error file): its export writes the completed rows to ``output``
and the others to ``error_output`` in one pass, by the output's rules (refused destinations, no file
replaced that the job did not write), and records both, with the rows' token sums (OpenAI's batch
``usage``); ``op open`` carries it and ``tenant`` through the protocol. Real redis-server."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from batchinfer.client.client import Client
from batchinfer.config import Settings
from batchinfer.jobs.export import export_job
from batchinfer.keys import DIRECT, Keys
from batchinfer.protocol.entries import JobOp, RequestError
from batchinfer.protocol.rows import ResultRow
from batchinfer.scheduler.daemon import SchedulerDaemon
from batchinfer.store.jobcontrol import check_open, open_job
from batchinfer.store.jobstore import JobField, JobStatus, JobStore, openai_batch
from batchinfer.store.publish import Publisher

PREFIX = "{eo}"
KEYS = Keys(PREFIX)
VICTIM_TEXT = "the operator's file\n"


@pytest.fixture
def places(tmp_path: Path, monkeypatch) -> tuple[Path, Path]:
    """The results root (the exporter's, from the environment) and a folder outside it."""
    root, outside = tmp_path / "results", tmp_path / "srv"
    root.mkdir()
    outside.mkdir()
    (outside / "victim.txt").write_text(VICTIM_TEXT)
    monkeypatch.setenv("BATCHINFER_RESULTS_ROOT", str(root))
    return root, outside


def _rows(job: str) -> list[ResultRow]:
    """Four rows: completed (with tokens), failed, completed (with tokens), cancelled (a few tokens)."""
    return [ResultRow(job_id=job, request_id=f"{job}:0", status="completed", idx=0, custom_id="a",
                      output_text="x", prompt_tokens=10, completion_tokens=4, cached_tokens=8),
            ResultRow.error("invalid_request", "bad", job_id=job, idx=1, custom_id="b", line=2),
            ResultRow(job_id=job, request_id=f"{job}:2", status="completed", idx=2, custom_id="c",
                      output_text="y", prompt_tokens=7, completion_tokens=3, cached_tokens=None),
            ResultRow(job_id=job, request_id=f"{job}:3", status="cancelled", idx=3, custom_id="d",
                      error_code="cancelled", error_message="the job was cancelled", prompt_tokens=5,
                      completion_tokens=1)]


def _finished(r, job: str, *, output: str | None, error_output: str | None, fmt: str = "openai") -> None:
    """Job ``job`` opened as a producer opens one (``open_job``, checked against the environment's
    settings, as the exporter's), its rows in: finalizing."""
    op = JobOp.open(job, model="m", output=output, output_format=fmt, error_output=error_output,
                    tenant="team-a")
    assert open_job(r, KEYS, op, Settings.from_env(prefix=PREFIX))
    pub = Publisher(r, KEYS)
    for row in _rows(job):
        pub.publish(row)
    assert pub.finish_submission(job, 4)


def _custom_ids(path: Path) -> list[str]:
    if path.suffix == ".parquet":
        return pq.read_table(path).column("custom_id").to_pylist()
    return [json.loads(line)["custom_id"] for line in path.read_text().splitlines()]


def test_the_export_writes_both_files_and_records_them_and_the_usage(redis_server, places):
    root, _ = places
    r = redis_server.client()
    _finished(r, "two", output="out/two.jsonl", error_output="out/two-errors.jsonl")
    location = export_job("two", prefix=PREFIX, redis_url=redis_server.url)
    out, err = root / "out" / "two.jsonl", root / "out" / "two-errors.jsonl"
    assert location == str(out)
    assert _custom_ids(out) == ["a", "c"] and _custom_ids(err) == ["b", "d"]
    assert all(json.loads(x)["error"] is None for x in out.read_text().splitlines())
    assert [json.loads(x)["error"]["code"] for x in err.read_text().splitlines()] == [
        "invalid_request", "batch_cancelled"]
    record = JobStore(r, KEYS).get("two")
    assert record.status is JobStatus.COMPLETED
    assert (record.output, record.error_output, record.tenant) == (str(out), str(err), "team-a")
    # the sums over every row (a null count is 0): OpenAI's usage
    assert (record.prompt_tokens, record.completion_tokens, record.cached_tokens) == (22, 8, 8)
    assert record.usage == {"input_tokens": 22, "input_tokens_details": {"cached_tokens": 8},
                            "output_tokens": 8, "output_tokens_details": {"reasoning_tokens": 0},
                            "total_tokens": 30}
    batch = openai_batch(record)
    assert batch["output_file_id"] == str(out) and batch["error_file_id"] == str(err)
    assert batch["usage"] == record.usage
    # a re-export replaces both of its own files; the record still names them
    err.write_text("stale\n")
    export_job("two", prefix=PREFIX, redis_url=redis_server.url)
    assert _custom_ids(err) == ["b", "d"]
    # an export to a caller's own output writes one file of every row: the record names just that one
    every = export_job("two", prefix=PREFIX, output=str(root / "all.jsonl"), redis_url=redis_server.url)
    assert _custom_ids(Path(every)) == ["a", "b", "c", "d"]
    record = JobStore(r, KEYS).get("two")
    assert (record.output, record.error_output) == (every, None)


def test_without_error_output_one_file_holds_every_row_and_the_usage_is_recorded(redis_server, places):
    root, _ = places
    r = redis_server.client()
    _finished(r, "one", output=None, error_output=None, fmt="parquet")
    assert export_job("one", prefix=PREFIX, redis_url=redis_server.url) == str(root / "one.parquet")
    assert _custom_ids(root / "one.parquet") == ["a", "b", "c", "d"]
    record = JobStore(r, KEYS).get("one")
    assert record.error_output is None and record.usage["total_tokens"] == 30
    assert openai_batch(record)["error_file_id"] is None
    assert not r.hexists(KEYS.job("one"), JobField.ERROR_OUTPUT)


def test_client_reads_both_parquet_files_back_once_the_stream_expired(redis_server, places):
    root, _ = places
    r = redis_server.client()
    _finished(r, "pq", output="pq.parquet", error_output="pq-errors.parquet", fmt="parquet")
    export_job("pq", prefix=PREFIX, redis_url=redis_server.url)
    assert _custom_ids(root / "pq.parquet") == ["a", "c"]
    assert _custom_ids(root / "pq-errors.parquet") == ["b", "d"]
    r.delete(KEYS.results("pq"))  # the results stream's TTL ran out: the files are what is left
    settings = Settings(redis_url=redis_server.url, prefix=PREFIX, results_root=str(root))
    with Client(settings=settings) as client:
        assert [row["custom_id"] for row in client.result_rows("pq")] == ["a", "b", "c", "d"]
        every = client.write_results("pq", str(root / "every.jsonl"), "jsonl")
    assert _custom_ids(Path(every)) == ["a", "b", "c", "d"]


def test_an_error_output_producers_may_not_name_is_refused_everywhere(redis_server, places, tmp_path):
    root, outside = places
    settings = Settings(redis_url=redis_server.url, prefix=PREFIX, results_root=str(root))
    victim = (outside / "victim.txt").as_uri()
    for bad, why in ((victim, "not an allowed destination"), ("../srv/victim.txt", "outside the results"),
                     ("s3://b/x?endpoint_override=h", "query string")):
        with pytest.raises(RequestError, match=why) as refused:
            check_open(JobOp.open("j", error_output=bad), settings)
        assert refused.value.field == "error_output" and refused.value.message.startswith("error_output: ")
    with pytest.raises(RequestError, match="must not be the output itself"):
        check_open(JobOp.open("j", output="x.jsonl", error_output="x.jsonl"), settings)
    # the client refuses it before anything is queued
    f = tmp_path / "in.jsonl"
    f.write_text('{"prompt": "a"}\n')
    with Client(settings=settings) as client:
        with pytest.raises(ValueError, match="not an allowed destination"):
            client.submit(f, model="m", error_output=victim)
        assert client.jobs() == []
    # the scheduler answers a raw op open with an invalid_request row and opens no job
    r = redis_server.client()
    r.xadd(KEYS.requests, {"v": "1", "op": "open", "job": "raw", "error_output": victim})
    r.xadd(KEYS.requests, {"v": "1", "op": "open", "job": "raw-ok", "error_output": "ok/e.jsonl",
                           "tenant": "t1"})
    sched = SchedulerDaemon(r, Settings(prefix=PREFIX, results_root=str(root)))
    while sched.run_once():
        pass
    [row] = [ResultRow.from_json(fields[b"row"]) for _, fields in r.xrange(KEYS.results(DIRECT))]
    assert row.error_code == "invalid_request" and row.error_message.startswith("error_output: ")
    assert not r.exists(KEYS.job("raw"))
    ok = JobStore(r, KEYS).get("raw-ok")
    assert (ok.error_output, ok.tenant) == ("ok/e.jsonl", "t1")
    # the exporter checks a record's error_output again (written by hand, or by an older build)
    _finished(r, "by-hand", output="h.jsonl", error_output=None)
    r.hset(KEYS.job("by-hand"), JobField.ERROR_OUTPUT, victim)
    with pytest.raises(ValueError, match="not an allowed destination"):
        export_job("by-hand", prefix=PREFIX, redis_url=redis_server.url)
    assert JobStore(r, KEYS).get("by-hand").status is JobStatus.FAILED
    assert (outside / "victim.txt").read_text() == VICTIM_TEXT and not (root / "h.jsonl").exists()


def test_an_error_file_the_job_did_not_write_is_kept_and_neither_file_is_written(redis_server, places):
    root, _ = places
    r = redis_server.client()
    (root / "taken.jsonl").write_text(VICTIM_TEXT)
    _finished(r, "clash", output="clash.jsonl", error_output="taken.jsonl")
    with pytest.raises(FileExistsError, match="not written by this job"):
        export_job("clash", prefix=PREFIX, redis_url=redis_server.url)
    assert (root / "taken.jsonl").read_text() == VICTIM_TEXT
    assert sorted(p.name for p in root.iterdir()) == ["taken.jsonl"]  # no output, no temporary
    record = JobStore(r, KEYS).get("clash")
    assert record.status is JobStatus.FAILED and record.exported_at is None and record.usage is None


def test_an_error_output_in_the_file_store_is_allowed(redis_server, places, monkeypatch, tmp_path):
    """Settings.output_prefixes(): the API's file store (BATCHINFER_FILES_DIR) is a destination too."""
    root, _ = places
    store = tmp_path / "filestore"
    monkeypatch.setenv("BATCHINFER_FILES_DIR", str(store))
    settings = Settings.from_env(prefix=PREFIX)
    error_at, output_at = (store / "file-e").as_uri(), (store / "file-o").as_uri()
    check_open(JobOp.open("fs", output=output_at, error_output=error_at), settings)
    r = redis_server.client()
    _finished(r, "fs", output=output_at, error_output=error_at)
    export_job("fs", prefix=PREFIX, redis_url=redis_server.url)
    assert _custom_ids(store / "file-o") == ["a", "c"] and _custom_ids(store / "file-e") == ["b", "d"]
    monkeypatch.delenv("BATCHINFER_FILES_DIR")
    with pytest.raises(RequestError, match="not an allowed destination"):
        check_open(JobOp.open("fs2", error_output=error_at), Settings.from_env(prefix=PREFIX))


def test_op_open_carries_error_output_and_tenant_on_the_wire():
    op = JobOp.open("j1", output="o.jsonl", error_output="e.jsonl", tenant="key_0123abcd")
    fields = op.to_fields()
    assert fields["error_output"] == "e.jsonl" and fields["tenant"] == "key_0123abcd"
    back = JobOp.from_fields({k.encode(): v.encode() for k, v in fields.items()})
    assert back.params == op.params
    assert back.record_fields()[-4:-2] == ["error_output", "e.jsonl"]
    for bad in ("a:b", "-lead", "x" * 129, "sp ace"):
        with pytest.raises(RequestError, match="tenant") as refused:
            JobOp.from_fields({"v": "1", "op": "open", "job": "j", "tenant": bad})
        assert refused.value.field == "tenant" and refused.value.code == "invalid_request"
    assert "tenant" not in JobOp.open("j").params and "error_output" not in JobOp.open("j").params
