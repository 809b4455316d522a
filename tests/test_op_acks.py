"""An applied job control entry (``op open`` / ``close`` / ``cancel``) with a ``reply_to`` is
acknowledged there (issue 28): a ``completed`` row whose ``request_id`` is the op's entry id, naming
the op, the job's status after it and its total. It is no request of the job: nothing reaches the
job's results, ``results:direct`` or its counts. An op that is not applied gets its error row only."""

from __future__ import annotations

import json

import pytest
from daemons import serve_tiny

from batchinfer.config import Settings
from batchinfer.keys import DIRECT, Keys
from batchinfer.protocol.rows import ResultRow
from batchinfer.scheduler.daemon import SchedulerDaemon
from batchinfer.store.jobstore import JobStore
from batchinfer.workers.text.tokenizer_files import read_tokenizer_files

KEYS = Keys("{a}")
CAP = {"max_model_len": 128, "max_num_seqs": 4, "max_num_batched_tokens": 256, "kv_tokens": 4096}
BODY = json.dumps({"prompt": "hello", "max_tokens": 2})
REPLY = "{a}:reply:producer"


@pytest.fixture
def r(redis_server, tiny_llama):
    r = redis_server.client()
    serve_tiny(r, KEYS, read_tokenizer_files(tiny_llama), CAP, ttl=60)
    return r


def run(r) -> None:
    sched = SchedulerDaemon(r, Settings(prefix=KEYS.prefix))
    while sched.run_once():
        pass


def xadd(r, **fields) -> str:
    return r.xadd(KEYS.requests, {k: str(v) for k, v in fields.items()}).decode()


def replies(r, stream: str = REPLY) -> list[dict]:
    return [json.loads(f[b"row"]) for _, f in r.xrange(stream)]


def test_applied_ops_are_acknowledged_on_their_reply_to_with_the_jobs_state(r):
    opened = xadd(r, v=1, op="open", job="j", model="tiny", reply_to=REPLY)
    xadd(r, v=1, job="j", idx=0, body=BODY)
    xadd(r, v=1, job="j", idx=1, body=BODY)
    closed = xadd(r, v=1, op="close", job="j", total=2, reply_to=REPLY)
    xadd(r, v=1, op="open", job="k", model="tiny")
    cancelled = xadd(r, v=1, op="cancel", job="k", reply_to=REPLY)
    run(r)
    acks = replies(r)
    assert [(a["request_id"], a["op"], a["job_status"], a["job_total"]) for a in acks] == [
        (opened, "open", "validating", None), (closed, "close", "in_progress", 2),
        (cancelled, "cancel", "cancelling", None)]  # until its export ends it
    for ack in acks:
        assert (ack["status"], ack["idx"], ack["error_code"]) == ("completed", None, None)
        assert ack["job_id"] in ("j", "k") and ack["created_at"] <= ack["finished_at"]
        row = ResultRow.from_json(json.dumps(ack))  # a row-reading consumer reads it as a row
        assert row.request_id == ack["request_id"] and row.status == "completed"
    assert r.ttl(REPLY) > 0  # a reply stream expires as it does for rows
    # no request of the job: neither the job's results nor results:direct nor the counts see it
    assert r.xlen(KEYS.results("j")) == 0 and not r.exists(KEYS.results(DIRECT))
    record = JobStore(r, KEYS).get("j")
    assert (record.submitted, record.completed, record.failed) == (2, 0, 0)


def test_an_op_that_is_not_applied_gets_its_error_row_only(r):
    xadd(r, v=1, op="close", job="nobody", total=1, reply_to=REPLY)
    xadd(r, v=1, op="open", job="j", model="tiny")
    xadd(r, v=1, op="close", job="j", total=1)
    again = xadd(r, v=1, op="close", job="j", total=3, reply_to=REPLY)  # another total: ignored
    run(r)
    got = replies(r)
    assert [(g["status"], g["error_code"], "op" in g) for g in got] == \
        [("failed", "protocol_error", False)] * 2
    assert got[1]["request_id"] == again and "already closed with total 1" in got[1]["error_message"]


def test_a_reply_to_key_of_another_type_is_left_alone(r):
    r.set(REPLY, "mine")
    xadd(r, v=1, op="open", job="j", model="tiny", reply_to=REPLY)
    xadd(r, v=1, job="j", idx=0, body=BODY)
    run(r)
    assert r.get(REPLY) == b"mine"
    assert JobStore(r, KEYS).get("j").submitted == 1  # the op was applied, and the intake went on
