"""``Client`` against a real redis-server: submit, status, cancel, jobs, wait, results, direct requests.

No scheduler runs here; where a result is needed, the test plays the far side of the protocol
through the real ``Publisher`` (the exactly-once Lua script).
"""

from __future__ import annotations

import json
import threading
import uuid
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchinfer.client.client import Client, JobNotFound, ModelNotServed, parse_duration
from batchinfer.config import Settings
from batchinfer.keys import RQ_QUEUE
from batchinfer.protocol.entries import IntakeEntry, JobOp
from batchinfer.protocol.rows import ResultRow
from batchinfer.store.jobstore import JobStatus
from batchinfer.store.publish import Publisher
from batchinfer.store.registry import Registry


@pytest.fixture
def client(redis_session):
    settings = Settings(redis_url=redis_session.url, prefix=f"{{t{uuid.uuid4().hex[:8]}}}")
    c = Client(settings=settings)
    yield c
    c.close()


def intake(client: Client) -> list[IntakeEntry]:
    """The request entries of the intake stream (not the job ops around them)."""
    entries = client.redis.xrange(client.keys.requests)
    return [IntakeEntry.from_fields(f) for _, f in entries if b"op" not in f]


def ops(client: Client) -> list[JobOp]:
    return [JobOp.from_fields(f) for _, f in client.redis.xrange(client.keys.requests) if b"op" in f]


def take_in(client: Client) -> None:
    """A scheduler pass over the intake stream: it applies the job's close (and counts its entries)."""
    from batchinfer.scheduler.daemon import SchedulerDaemon

    sched = SchedulerDaemon(client.redis, client.settings)
    while sched.run_once():
        pass


def test_submit_jsonl_streams_raw_lines(client, tmp_path):
    lines = ['{"prompt": "a", "max_tokens": 2}', "{not json", "",
             '{"custom_id": "o", "method": "POST", "url": "/v1/completions", "body": {"prompt": "b"}}']
    f = tmp_path / "in.jsonl"
    f.write_text("\n".join(lines) + "\n")
    job_id = client.submit(f, model="tiny", priority=2, completion_window="2h", metadata={"team": "x"},
                           output="out/x.parquet")
    entries = intake(client)
    assert [(e.job_id, e.idx, e.line, e.body) for e in entries] == [
        (job_id, 0, 1, lines[0]), (job_id, 1, 2, lines[1]), (job_id, 2, 4, lines[3])]
    # sent as any producer sends a job: op open (the record exists already), entries, op close
    assert [(o.op, o.job_id) for o in ops(client)] == [("open", job_id), ("close", job_id)]
    assert ops(client)[1].params == {"total": 3}
    record = client.status(job_id)  # readable at once, with its total
    assert record.status == JobStatus.IN_PROGRESS and (record.total, record.submitted) == (3, 0)
    take_in(client)  # the scheduler counts what it takes in, and applies the close (a no-op here)
    record = client.status(job_id)
    assert record.status == JobStatus.IN_PROGRESS and record.in_progress_at is not None
    assert (record.total, record.submitted, record.model, record.priority) == (3, 3, "tiny", 2)
    # the scheduler answered the bad line and holds the other two: no worker serves "tiny"
    counts = record.request_counts
    assert (counts["total"], counts["completed"], counts["failed"], counts["held"]) == (3, 0, 1, 2)
    assert record.input_name == "in.jsonl" and record.output == "out/x.parquet"
    assert record.metadata == {"team": "x"} and record.completion_window == 7200
    assert record.expires_at - record.created_at == 7200 * 1000


def test_submit_in_many_chunks_reports_progress(client, monkeypatch):
    monkeypatch.setattr("batchinfer.client.client.SUBMIT_CHUNK", 7)
    seen = []
    job_id = client.submit(({"prompt": f"p{i}"} for i in range(50)), on_progress=seen.append)
    assert seen == [7, 14, 21, 28, 35, 42, 49, 50]
    entries = intake(client)
    assert [e.idx for e in entries] == list(range(50))
    assert json.loads(entries[49].body) == {"prompt": "p49"}
    take_in(client)  # `submitted` counts what the scheduler took in
    assert client.status(job_id).submitted == 50


def test_over_long_line_becomes_an_error_row_at_once(client, tmp_path):
    client.settings.max_line_bytes = 40
    f = tmp_path / "in.jsonl"
    f.write_text('{"prompt": "ok"}\n{"prompt": "' + "x" * 100 + '"}\n{"prompt": "ok2"}\n')
    job_id = client.submit(f)
    assert [(e.idx, e.line) for e in intake(client)] == [(0, 1), (2, 3)]
    rows = list(client.result_rows(job_id))
    assert len(rows) == 1
    row = rows[0]
    assert (row["idx"], row["line"], row["status"], row["error_code"]) == (1, 2, "failed", "line_too_long")
    assert "more than the limit of 40 bytes" in row["error_message"]
    record = client.status(job_id)
    assert (record.total, record.submitted, record.failed, record.status) == (3, 1, 1, JobStatus.IN_PROGRESS)
    take_in(client)  # the other two lines have no model (the job names none)
    record = client.status(job_id)
    assert (record.total, record.submitted, record.completed, record.failed) == (3, 3, 0, 3)
    assert record.status == JobStatus.FINALIZING


def test_job_of_only_bad_lines_finalizes_and_enqueues_its_export(client, tmp_path):
    client.settings.max_line_bytes = 10
    f = tmp_path / "in.jsonl"
    f.write_text('{"prompt": "far too long"}\n')
    job_id = client.submit(f)
    assert client.status(job_id).status == JobStatus.FINALIZING
    from rq import Queue
    from rq.serializers import JSONSerializer

    queue = Queue(RQ_QUEUE, connection=client.redis, serializer=JSONSerializer)
    assert any(job_id in (j.args or []) for j in queue.jobs)


def test_submit_dataframe_and_parquet(client, tmp_path):
    df = pd.DataFrame({"custom_id": ["a", "b"], "prompt": ["x", "y"], "max_tokens": [3, 4]})
    job1 = client.submit(df, model="m")
    f = tmp_path / "in.parquet"
    pq.write_table(pa.table({"messages": [[{"role": "user", "content": "hi"}]]}), f)
    job2 = client.submit(f, model="m")
    entries = intake(client)
    assert [(e.job_id, e.line) for e in entries] == [(job1, 1), (job1, 2), (job2, 1)]
    assert json.loads(entries[1].body) == {"custom_id": "b", "prompt": "y", "max_tokens": 4}
    assert json.loads(entries[2].body) == {"messages": [{"role": "user", "content": "hi"}]}
    assert client.status(job2).input_name == "in.parquet"


def test_job_ids_are_never_reused(client):
    client.submit([{"prompt": "a"}], job_id="my-job-1")
    with pytest.raises(ValueError, match="already exists"):
        client.submit([{"prompt": "a"}], job_id="my-job-1")
    with pytest.raises(ValueError, match="invalid"):
        client.submit([{"prompt": "a"}], job_id="bad id")


def test_interrupted_submission_cancels_the_job(client):
    def records():
        yield {"prompt": "a"}
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        client.submit(records())
    [record] = client.jobs()
    assert record.status == JobStatus.CANCELLING
    assert record.errors and "submission interrupted" in record.errors[0]
    assert client.store.is_cancelled(record.id)


def test_status_cancel_jobs(client):
    first = client.submit([{"prompt": "a"}])
    second = client.submit([{"prompt": "b"}])
    assert [j.id for j in client.jobs()] == [second, first]
    assert [j.id for j in client.jobs(limit=1)] == [second]
    assert client.cancel(first) == JobStatus.CANCELLING
    assert client.status(first).cancelling_at is not None
    assert client.store.cancelled_jobs() == {first}
    client.store.set_status(second, JobStatus.COMPLETED)
    assert client.cancel(second) == JobStatus.COMPLETED  # an ended job stays as it is
    with pytest.raises(JobNotFound, match="no job 'nope'"):
        client.status("nope")
    with pytest.raises(JobNotFound):
        client.cancel("nope")


def test_wait_returns_at_the_end_and_times_out(client):
    job_id = client.submit([{"prompt": "a"}])
    with pytest.raises(TimeoutError, match="still in_progress"):
        client.wait(job_id, timeout=0.2, poll_seconds=0.05)
    seen = []
    timer = threading.Timer(0.2, lambda: client.store.set_status(job_id, JobStatus.COMPLETED))
    timer.start()
    record = client.wait(job_id, timeout=30, poll_seconds=0.05, progress=seen.append)
    timer.join()
    assert record.status == JobStatus.COMPLETED and seen[-1].status == JobStatus.COMPLETED
    assert len(seen) >= 2


def publish_rows(client: Client, job_id: str, idxs: list[int]) -> None:
    publisher = Publisher(client.redis, client.keys)
    for idx in idxs:
        row = ResultRow(job_id=job_id, request_id=f"{job_id}:{idx}", idx=idx, status="completed",
                        output_text=f"out{idx}", output_token_ids=[idx, idx + 1], prompt_tokens=2,
                        completion_tokens=2, finished_at=1_700_000_000_000, metadata={"i": str(idx)})
        assert publisher.publish(row).published


def test_results_in_input_order(client, tmp_path):
    job_id = client.submit([{"prompt": str(i)} for i in range(5)])
    publish_rows(client, job_id, [3, 0, 4, 1, 2])
    table = client.results_table(job_id)
    assert table.column("idx").to_pylist() == [0, 1, 2, 3, 4]
    assert table.column("output_token_ids").to_pylist()[3] == [3, 4]
    df = client.results(job_id)
    assert list(df["output_text"]) == [f"out{i}" for i in range(5)]
    assert client.status(job_id).status == JobStatus.FINALIZING
    written = []
    path = client.write_results(job_id, str(tmp_path / "r.jsonl"), fmt="jsonl",
                                on_row=lambda: written.append(1))
    lines = [json.loads(x) for x in Path(path).read_text().splitlines()]
    assert [x["idx"] for x in lines] == [0, 1, 2, 3, 4]
    assert len(written) == 5  # the progress callback saw every row


def test_results_fall_back_to_the_exported_file(client, tmp_path):
    job_id = client.submit([{"prompt": str(i)} for i in range(3)])
    publish_rows(client, job_id, [2, 1, 0])
    out = client.write_results(job_id, str(tmp_path / "r.parquet"))
    client.redis.delete(client.keys.results(job_id))  # as after the results TTL
    client.store.set_status(job_id, JobStatus.COMPLETED, output=out)
    assert client.results(job_id)["idx"].tolist() == [0, 1, 2]
    again = client.write_results(job_id, str(tmp_path / "again.jsonl"), fmt="jsonl")
    metadata = [json.loads(x)["metadata"] for x in Path(again).read_text().splitlines()]
    assert metadata == [{"i": "0"}, {"i": "1"}, {"i": "2"}]


def answer_direct_requests(client: Client, count: int, stop: threading.Event) -> threading.Thread:
    """Reads intake entries and publishes one row per entry to its reply_to stream."""
    publisher = Publisher(client.redis, client.keys)

    def run():
        last, done = "0-0", 0
        while done < count and not stop.is_set():
            got = client.redis.xread({client.keys.requests: last}, block=100)
            for entry_id, fields in (got[0][1] if got else []):
                last = entry_id
                entry = IntakeEntry.from_fields(fields)
                body = json.loads(entry.body)
                row = ResultRow(job_id=None, request_id=entry_id.decode(), status="completed",
                                custom_id=body.get("custom_id"), model=body.get("model"),
                                output_text=body["prompt"].upper())
                publisher.publish(row, reply_to=entry.reply_to)
                done += 1

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_request_and_requests_through_reply_to(client):
    stop = threading.Event()
    thread = answer_direct_requests(client, 4, stop)
    try:
        row = client.request({"prompt": "abc"}, model="tiny", timeout=10)
        assert row.output_text == "ABC" and row.model == "tiny" and row.job_id is None
        rows = list(client.requests([{"custom_id": f"c{i}", "prompt": f"x{i}"} for i in range(3)],
                                    model="tiny", timeout=10, window=2))
        got = sorted((r.custom_id, r.output_text) for r in rows)
        assert got == [("c0", "X0"), ("c1", "X1"), ("c2", "X2")]
    finally:
        stop.set()
        thread.join(timeout=5)
    assert not client.redis.keys(f"{client.keys.prefix}:reply:*")  # private streams are removed


def test_results_keep_integer_dtypes_with_missing_values(client):
    job_id = client.submit([{"prompt": "a"}, {"prompt": "b"}])
    publish_rows(client, job_id, [0])
    failed = ResultRow.error("invalid_request", "bad", job_id=job_id, idx=1)
    Publisher(client.redis, client.keys).publish(failed)
    df = client.results(job_id)
    # nullable ints, not float64 ("prompt_tokens 30.0"); a failed row's are missing (pd.NA)
    for name in ("prompt_tokens", "completion_tokens", "idx"):
        assert pd.api.types.is_integer_dtype(df[name].dtype), (name, df[name].dtype)
    assert str(df["prompt_tokens"].dtype) in ("Int32", "Int64")
    assert df["prompt_tokens"][0] == 2 and df["prompt_tokens"].isna()[1]
    assert df["prompt_tokens"].tolist()[0] == 2 and not isinstance(df["prompt_tokens"].tolist()[0], float)


def test_request_times_out_without_a_scheduler(client):
    # a model no worker serves: the timeout says so (a TimeoutError still), and what is served
    with pytest.raises(ModelNotServed, match=r"^1 request held: model 'm' is not served; served: none$"):
        client.request({"prompt": "x", "model": "m"}, timeout=0.2, hold_seconds=30)
    [entry] = intake(client)
    assert entry.job_id is None and entry.reply_to.startswith(client.keys.prefix + ":reply:")
    assert entry.hold_seconds == 30
    # a served model: the plain timeout
    Registry(client.redis, client.keys).heartbeat_worker("w1", {"model": "m", "capacity": {}}, ttl=60)
    with pytest.raises(TimeoutError, match="no result") as info:
        client.request({"prompt": "x", "model": "m"}, timeout=0.2)
    assert not isinstance(info.value, ModelNotServed)


def test_parse_duration():
    values = ("24h", "30m", "90s", "2d", "15", 60)
    assert [parse_duration(v) for v in values] == [86400, 1800, 90, 172800, 15, 60]
    for bad in ("0h", "tomorrow", "1w", -5, "1.5h"):
        with pytest.raises(ValueError, match="completion window"):
            parse_duration(bad)
