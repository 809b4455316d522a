"""Jobs from any language with intake entries alone: ``op open`` / request entries / ``op close``
(docs/protocol.md, "Jobs"), applied by the scheduler in stream order, against a real redis-server."""

from __future__ import annotations

import json

import pytest
from daemons import serve_tiny

from batchinfer.client.client import Client
from batchinfer.config import Settings
from batchinfer.keys import DIRECT, Keys
from batchinfer.protocol.rows import BatchRequest, ResultRow
from batchinfer.scheduler.daemon import SchedulerDaemon
from batchinfer.store.jobstore import JobStatus, JobStore
from batchinfer.store.publish import Publisher
from batchinfer.workers.text.tokenizer_files import read_tokenizer_files

KEYS = Keys("{o}")
CAP = {"max_model_len": 128, "max_num_seqs": 4, "max_num_batched_tokens": 256, "kv_tokens": 4096}
BODY = json.dumps({"prompt": "hello", "max_tokens": 2})


@pytest.fixture
def r(redis_server, tiny_llama):
    r = redis_server.client()
    serve_tiny(r, KEYS, read_tokenizer_files(tiny_llama), CAP, ttl=60)
    return r


def scheduler(r) -> SchedulerDaemon:
    sched = SchedulerDaemon(r, Settings(prefix=KEYS.prefix))
    sched.dispatcher.jobs.ttl = 0
    return sched


def run(sched: SchedulerDaemon, passes: int = 20) -> None:
    for _ in range(passes):
        if sched.run_once() == 0:
            return


def xadd(r, **fields) -> str:
    return r.xadd(KEYS.requests, {k: str(v) for k, v in fields.items()}).decode()


def answer_batches(r, model: str = "tiny") -> list[BatchRequest]:
    """Play the worker: publish a completed row for every request in ``model``'s batches."""
    publisher, done = Publisher(r, KEYS), []
    for entry_id, fields in r.xrange(KEYS.batches(model)):
        for q in map(BatchRequest.from_dict, json.loads(fields[b"requests"])):
            publisher.publish(ResultRow(job_id=q.job_id, request_id=q.request_id, idx=q.idx, model=q.model,
                                        status="completed", output_text="ok", finished_at=1), q.reply_to)
            done.append(q)
        r.xdel(KEYS.batches(model), entry_id)
    return done


def rows(r, stream: str) -> list[ResultRow]:
    return [ResultRow.from_json(f[b"row"]) for _, f in r.xrange(stream)]


def record(r, job: str):
    return JobStore(r, KEYS).get(job)


def test_a_job_from_intake_entries_alone_opens_runs_and_finalizes(r):
    xadd(r, v=1, op="open", job="j1", model="tiny", completion_window="1h", priority=3,
         metadata='{"team": "x"}', input_name="node-producer")
    for i in range(3):
        xadd(r, v=1, job="j1", idx=i, body=BODY)
    xadd(r, v=1, op="close", job="j1", total=3)
    sched = scheduler(r)
    run(sched)
    rec = record(r, "j1")
    assert rec.status == JobStatus.IN_PROGRESS and (rec.total, rec.submitted) == (3, 3)
    assert (rec.model, rec.priority, rec.metadata) == ("tiny", 3, {"team": "x"})
    assert rec.input_name == "node-producer"
    assert rec.expires_at - rec.created_at == 3600 * 1000
    assert sorted(q.idx for q in answer_batches(r)) == [0, 1, 2]
    assert record(r, "j1").status == JobStatus.FINALIZING  # the last row finalized it
    assert r.xlen(KEYS.requests) == 0  # every entry, ops included, acked and deleted


def test_a_close_after_every_row_is_in_finalizes_the_job(r):
    # the bug of a hand-written HSET total: rows all finished first, the job stayed in_progress
    xadd(r, v=1, op="open", job="j2", model="tiny")
    xadd(r, v=1, job="j2", idx=0, body=BODY)
    xadd(r, v=1, job="j2", idx=1, body=BODY)
    sched = scheduler(r)
    run(sched)
    answer_batches(r)
    assert record(r, "j2").status == JobStatus.VALIDATING and record(r, "j2").completed == 2
    xadd(r, v=1, op="close", job="j2", total=2)
    run(sched)
    assert record(r, "j2").status == JobStatus.FINALIZING


def test_entries_a_job_cannot_count_get_clear_errors_and_nothing_runs(r):
    xadd(r, v=1, op="open", job="j3", model="tiny")
    xadd(r, v=1, job="j3", idx=0, body=BODY)
    xadd(r, v=1, job="j3", idx=0, body=BODY, reply_to="{o}:reply:dup")  # duplicate idx
    xadd(r, v=1, job="j3", idx=1, body=BODY)
    xadd(r, v=1, op="close", job="j3", total=2)
    xadd(r, v=1, job="j3", idx=2, body=BODY, reply_to="{o}:reply:range")  # idx >= total of a closed job
    xadd(r, v=1, job="nojob", idx=0, body=BODY, reply_to="{o}:reply:nojob")  # no such job
    xadd(r, v=1, idx=4, body=BODY, reply_to="{o}:reply:nojobfield")  # idx without job
    xadd(r, v=1, op="close", job="j3", total=5, reply_to="{o}:reply:reclose")  # another total
    sched = scheduler(r)
    run(sched)
    assert sorted(q.idx for q in answer_batches(r)) == [0, 1]  # only the two good entries ran
    rec = record(r, "j3")
    assert (rec.status, rec.total, rec.submitted, rec.completed, rec.failed) == (
        JobStatus.FINALIZING, 2, 2, 2, 0)  # "2/2", never "4/3"
    expected = {"dup": "idx 0 of job 'j3' was already taken in",
                "range": "idx 2 is out of range: job 'j3' was closed with total 2",
                "nojob": "job 'nojob' does not exist: open it first",
                "nojobfield": "an entry with 'idx' needs 'job'", "reclose": "already closed with total 2"}
    for name, message in expected.items():
        [row] = rows(r, f"{{o}}:reply:{name}")
        assert row.status == "failed" and row.error_code == "protocol_error" and row.job_id is None, name
        assert message in row.error_message, (name, row.error_message)
    assert len(rec.errors) == 3 and "already taken in" in rec.errors[0]  # dup, range, reclose
    assert not r.exists(KEYS.results("nojob")) and not r.exists(KEYS.job("nojob"))  # nothing stray
    assert len(rows(r, KEYS.results(DIRECT))) == 5  # each refusal is answered as a direct request


def test_a_close_fills_gaps_and_takes_in_entries_past_its_total(r):
    xadd(r, v=1, op="open", job="j4", model="tiny")
    for i in (0, 2, 5):
        xadd(r, v=1, job="j4", idx=i, body=BODY)
    xadd(r, v=1, op="close", job="j4", total=4)
    xadd(r, v=1, job="j4", idx=1, body=BODY, reply_to="{o}:reply:late")  # its gap was filled
    sched = scheduler(r)
    run(sched)
    answer_batches(r)
    rec = record(r, "j4")
    assert (rec.total, rec.completed, rec.failed, rec.status) == (6, 3, 3, JobStatus.FINALIZING)
    gaps = {row.idx: row for row in rows(r, KEYS.results("j4")) if row.status == "failed"}
    assert sorted(gaps) == [1, 3, 4]
    assert gaps[3].error_code == "protocol_error" and "no entry with idx 3" in gaps[3].error_message
    assert any("entries up to idx 5" in e for e in rec.errors)
    assert any("3 idx had no entry (1, 3, 4)" in e for e in rec.errors)
    [late] = rows(r, "{o}:reply:late")
    assert "already taken in" in late.error_message


def test_a_scheduler_restart_between_entries_and_close_loses_and_doubles_nothing(r):
    xadd(r, v=1, op="open", job="j5", model="tiny")
    for i in range(3):
        xadd(r, v=1, job="j5", idx=i, body=BODY)
    run(scheduler(r))
    xadd(r, v=1, job="j5", idx=1, body=BODY)  # a duplicate seen only by the next scheduler
    xadd(r, v=1, op="close", job="j5", total=3)
    xadd(r, v=1, op="close", job="j5", total=3)  # a repeated close is a no-op
    run(scheduler(r))
    answer_batches(r)
    rec = record(r, "j5")
    assert (rec.submitted, rec.total, rec.completed, rec.failed) == (3, 3, 3, 0)


def test_op_errors_and_cancel(r):
    xadd(r, v=1, op="open", job="bad", output_format="xml", reply_to="{o}:reply:open")
    xadd(r, v=1, op="open", job="j6", model="tiny", bogus=1, reply_to="{o}:reply:field")
    xadd(r, v=1, op="close", job="j7", reply_to="{o}:reply:close")  # no total
    xadd(r, v=1, op="launch", job="j7", reply_to="{o}:reply:op")
    xadd(r, v=1, op="open", job="j8", model="tiny")
    xadd(r, v=1, op="cancel", job="j8")
    run(scheduler(r))
    for name, message in {"open": "output_format: must be one of parquet, jsonl, openai",
                          "field": "unknown field(s) for op open: bogus", "close": "op close needs 'total'",
                          "op": "op must be one of open, close, cancel"}.items():
        [row] = rows(r, f"{{o}}:reply:{name}")
        assert message in row.error_message, (name, row.error_message)
    assert not r.exists(KEYS.job("bad")) and not r.exists(KEYS.job("j6"))
    assert record(r, "j8").status == JobStatus.CANCELLING


def test_the_python_client_uses_the_same_path(r, redis_server):
    client = Client(settings=Settings(redis_url=redis_server.url, prefix=KEYS.prefix))
    job = client.submit([{"prompt": "a", "max_tokens": 2}, {"prompt": "b", "max_tokens": 2}], model="tiny")
    assert (client.status(job).status, client.status(job).total) == (JobStatus.IN_PROGRESS, 2)  # at once
    sched = scheduler(r)
    run(sched)
    assert len(answer_batches(r)) == 2
    rec = client.status(job)
    assert (rec.total, rec.submitted, rec.completed, rec.status) == (2, 2, 2, JobStatus.FINALIZING)
    client.close()


def test_job_op_fields_round_trip_and_validate():
    from batchinfer.protocol.entries import IntakeEntry, JobOp, RequestError, parse_entry

    op = JobOp.open("j", model="m", completion_window="2h", priority=1, metadata={"k": "v"}, input_name="f")
    fields = op.to_fields()
    assert (fields["op"], fields["completion_window"]) == ("open", "7200")
    assert json.loads(fields["metadata"]) == {"k": "v"}
    back = parse_entry({k.encode(): v.encode() for k, v in fields.items()})
    assert isinstance(back, JobOp) and back.params == op.params
    assert JobOp.close("j", 3).to_fields() == {"v": "1", "op": "close", "job": "j", "total": "3"}
    with pytest.raises(RequestError, match="total: must be a non-negative integer"):
        JobOp.close("j", -1)
    with pytest.raises(RequestError, match="completion_window"):
        JobOp.open("j", completion_window="soon")
    entry = IntakeEntry(body="{}", hold_seconds=0.5)
    assert entry.to_fields()["hold_seconds"] == "0.5"
    assert IntakeEntry.from_fields(entry.to_fields()).hold_seconds == 0.5
