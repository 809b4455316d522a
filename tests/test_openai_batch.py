"""The OpenAI Batch object of a job (``openai_batch``, ``batchinfer status JOB --json --format openai``)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from batchinfer.cli.main import cli
from batchinfer.jobs.export import export_job
from batchinfer.keys import Keys
from batchinfer.protocol.rows import ResultRow
from batchinfer.store.jobstore import JobStatus, JobStore, openai_batch
from batchinfer.store.publish import Publisher

PREFIX = "{ob}"
KEYS = Keys(PREFIX)
OPENAI_KEYS = {"id", "object", "endpoint", "errors", "input_file_id", "completion_window", "status",
               "output_file_id", "error_file_id", "created_at", "in_progress_at", "expires_at",
               "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at", "cancelled_at",
               "request_counts", "metadata", "usage"}


def _row(job: str, idx: int, status: str) -> ResultRow:
    if status == "completed":
        return ResultRow(job_id=job, idx=idx, request_id=f"{job}:{idx}", status=status, output_text="x")
    return ResultRow.error(status, "no", status=status, job_id=job, idx=idx)


def test_a_finished_job_as_an_openai_batch(redis_server, tmp_path):
    r = redis_server.client()
    store, pub = JobStore(r, KEYS), Publisher(r, KEYS)
    store.create("b1", model="m", input_name="in.jsonl", metadata={"team": "a"})
    running = openai_batch(store.get("b1"))
    assert set(running) == OPENAI_KEYS and running["object"] == "batch" and running["status"] == "validating"
    assert running["output_file_id"] is None and running["error_file_id"] is None
    assert running["completion_window"] == "24h" and running["errors"] is None
    assert running["usage"] is None  # until the export sums the rows' tokens
    for i, status in enumerate(["completed", "completed", "failed", "cancelled"]):
        pub.publish(_row("b1", i, status))
    assert pub.finish_submission("b1", 4)
    assert store.cancel("b1") is JobStatus.FINALIZING  # nothing left to cancel: every row is in
    out = tmp_path / "b1.parquet"
    export_job("b1", prefix=PREFIX, output=str(out), redis_url=redis_server.url)
    record = store.get("b1")
    batch = openai_batch(record)
    assert batch["id"] == "b1" and batch["input_file_id"] == "in.jsonl" and batch["metadata"] == {"team": "a"}
    assert batch["status"] == record.status.value == "completed"
    # OpenAI's three counts: failed there is every request that did not complete
    assert batch["request_counts"] == {"total": 4, "completed": 2, "failed": 2}
    # unix seconds, not our ms
    assert batch["created_at"] == record.created_at // 1000
    assert batch["completed_at"] == record.completed_at // 1000
    assert batch["expires_at"] - batch["created_at"] in (24 * 3600, 24 * 3600 + 1)
    assert batch["cancelled_at"] is None and batch["failed_at"] is None
    # the results file holds the error rows too: no second file to name (an OpenAI client reads both)
    assert batch["output_file_id"] == str(out) and batch["error_file_id"] is None
    # the rows carry no token counts here: usage is all zeros, not null (the export ran)
    assert batch["usage"] == {"input_tokens": 0, "input_tokens_details": {"cached_tokens": 0},
                              "output_tokens": 0, "output_tokens_details": {"reasoning_tokens": 0},
                              "total_tokens": 0}


def test_errors_and_a_short_window(redis_server):
    r = redis_server.client()
    store = JobStore(r, KEYS)
    store.create("b2", completion_window=90)
    r.hset(KEYS.job("b2"), mapping={"status": JobStatus.FAILED.value, "failed_at": 1_700_000_000_123,
                                    "errors": json.dumps(["export failed: disk full"])})
    batch = openai_batch(store.get("b2"))
    assert batch["completion_window"] == "90s" and batch["failed_at"] == 1_700_000_000
    error = {"code": "job_error", "message": "export failed: disk full", "param": None, "line": None}
    assert batch["errors"] == {"object": "list", "data": [error]}
    assert batch["metadata"] is None


def test_status_format_openai_on_the_command_line(redis_server):
    r = redis_server.client()
    store = JobStore(r, KEYS)
    store.create("b3", model="m")
    args = ["--redis-url", redis_server.url, "--prefix", PREFIX, "--log-level", "WARNING"]
    result = CliRunner().invoke(cli, [*args, "status", "b3", "--json", "--format", "openai"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == openai_batch(store.get("b3"))
    plain = CliRunner().invoke(cli, [*args, "status", "b3", "--json"], catch_exceptions=False)
    assert json.loads(plain.output)["request_counts"]["cancelled"] == 0  # our record, by default
