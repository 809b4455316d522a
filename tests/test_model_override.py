"""The job's model wins over each line's own ``model`` (an OpenAI batch file names a hosted model in
every line); overridden lines are counted in the job record, exactly, across a scheduler restart."""

from __future__ import annotations

import json

from batchinfer.client.client import Client
from batchinfer.config import Settings
from batchinfer.keys import Keys
from batchinfer.protocol.rows import BatchRequest, ResultRow
from batchinfer.scheduler.daemon import SchedulerDaemon
from batchinfer.store.publish import Publisher
from batchinfer.store.registry import Registry
from batchinfer.workers.text.tokenizer_files import read_tokenizer_files

KEYS = Keys("{m}")
CAP = {"max_model_len": 128, "max_num_seqs": 4, "max_num_batched_tokens": 256, "kv_tokens": 4096}


def openai_line(i: int, model: str) -> dict:
    return {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 2}}


def run(sched: SchedulerDaemon) -> None:
    while sched.run_once():
        pass


def answer_batches(r) -> list[BatchRequest]:
    publisher, done = Publisher(r, KEYS), []
    for entry_id, fields in r.xrange(KEYS.batches("tiny")):
        for q in map(BatchRequest.from_dict, json.loads(fields[b"requests"])):
            publisher.publish(ResultRow(job_id=q.job_id, request_id=q.request_id, idx=q.idx, model=q.model,
                                        status="completed", output_text="ok", finished_at=1))
            done.append(q)
        r.xdel(KEYS.batches("tiny"), entry_id)
    return done


def _served_tiny(redis_server, tiny_llama):
    """Redis with model "tiny" registered and one live worker serving it, and a client."""
    r = redis_server.client()
    registry = Registry(r, KEYS)
    registry.register_model("tiny", read_tokenizer_files(tiny_llama), CAP)
    registry.heartbeat_worker("w1", {"model": "tiny", "capacity": CAP}, ttl=60)
    return r, Client(settings=Settings(redis_url=redis_server.url, prefix=KEYS.prefix))


def test_the_jobs_model_answers_every_line_and_the_overridden_names_are_counted(redis_server, tiny_llama):
    r, client = _served_tiny(redis_server, tiny_llama)
    lines = [openai_line(i, "gpt-4o-mini") for i in range(5)] + [openai_line(5, "tiny")]
    job = client.submit(lines, model="tiny")
    run(SchedulerDaemon(r, Settings(prefix=KEYS.prefix)))
    ran = answer_batches(r)
    assert len(ran) == 6 and {q.model for q in ran} == {"tiny"}  # no line waits for "gpt-4o-mini"
    record = client.status(job)
    assert (record.completed, record.status.value) == (6, "finalizing")
    assert {row["model"] for row in client.result_rows(job)} == {"tiny"}
    assert (record.models_overridden, record.overridden_models) == (5, ["gpt-4o-mini"])
    assert record.to_dict()["overridden_models"] == ["gpt-4o-mini"]

    # the names add up, the count stays exact, at most 8 names; a restarted scheduler reads the
    # names already recorded
    names = [f"hosted-{i}" for i in range(10)]
    job2 = client.submit([openai_line(i, names[i]) for i in range(3)] + [openai_line(9, "gpt-4o-mini")],
                         model="tiny")
    run(SchedulerDaemon(r, Settings(prefix=KEYS.prefix)))
    assert client.status(job2).overridden_models == ["hosted-0", "hosted-1", "hosted-2", "gpt-4o-mini"]
    # one job whose entries two scheduler processes take in (a restart in the middle)
    r.xadd(KEYS.requests, {"v": "1", "op": "open", "job": "j3", "model": "tiny"})
    for i in range(10):
        if i == 5:
            run(SchedulerDaemon(r, Settings(prefix=KEYS.prefix)))
        body = json.dumps(openai_line(i, names[i]))
        r.xadd(KEYS.requests, {"v": "1", "job": "j3", "idx": str(i), "body": body})
    r.xadd(KEYS.requests, {"v": "1", "op": "close", "job": "j3", "total": "10"})
    run(SchedulerDaemon(r, Settings(prefix=KEYS.prefix)))
    record3 = client.status("j3")
    assert (record3.total, record3.submitted) == (10, 10)
    assert record3.models_overridden == 10 and record3.overridden_models == names[:8]
    client.close()


def test_a_line_model_is_used_when_the_job_names_none(redis_server, tiny_llama):
    r, client = _served_tiny(redis_server, tiny_llama)
    job = client.submit([openai_line(0, "tiny")])
    run(SchedulerDaemon(r, Settings(prefix=KEYS.prefix)))
    assert [q.model for q in answer_batches(r)] == ["tiny"]
    assert client.status(job).models_overridden == 0
    client.close()
