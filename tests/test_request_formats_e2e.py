"""A ``/v1/responses`` line and Anthropic Message Batches lines (issue 29) through the real queue: the
client's readers (records, a Parquet ``params`` column, a direct request), the scheduler's intake and
a worker daemon (the echo engine with the byte tokenizer's chat template) give completed rows."""

from __future__ import annotations

import concurrent.futures
import json
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from daemons import ThreadedWorker, worker_daemon

from batchinfer.client.client import Client
from batchinfer.config import Settings
from batchinfer.scheduler.daemon import SchedulerDaemon
from batchinfer.store.jobstore import JobStatus, JobStore
from batchinfer.store.registry import Registry
from batchinfer.workers.service.echo_engine import EchoEngine

PREFIX = "{formats}"
MODEL = "echo"

RESPONSES_LINE = {"custom_id": "resp-1", "method": "POST", "url": "/v1/responses", "body": {
    "model": "gpt-4.1-mini", "instructions": "Be brief.", "max_output_tokens": 4, "store": False,
    "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hello"}]}],
    "reasoning": {"effort": "low"}, "metadata": {"team": "a"}}}
PARAMS = {"model": "claude-sonnet-4-5", "max_tokens": 4, "system": "Be brief.", "temperature": 0,
          "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}],
          "metadata": {"user_id": "u-1"}}
ANTHROPIC_LINE = {"custom_id": "anth-1", "params": PARAMS}


@pytest.fixture(scope="module")
def queue(redis_module):
    settings = Settings(redis_url=redis_module.url, prefix=PREFIX, heartbeat_seconds=0.3)
    client = Client(settings=settings)
    worker = ThreadedWorker(worker_daemon(client.redis, settings, EchoEngine(MODEL, max_model_len=256), "w1",
                                          block_ms=50, cancel_poll_seconds=0.2))
    registry = Registry(client.redis, client.keys)
    deadline = time.monotonic() + 60
    while MODEL not in registry.models():
        assert time.monotonic() < deadline and worker.error is None, worker.error
        time.sleep(0.02)
    scheduler = SchedulerDaemon(client.redis, settings, name="sched-formats")
    yield client, scheduler
    assert worker.stop() == 0
    client.close()


def drain(client: Client, scheduler: SchedulerDaemon, job: str) -> list[dict]:
    """Step the scheduler until the job has all its rows; the rows by custom_id."""
    store, deadline = JobStore(client.redis, client.keys), time.monotonic() + 60
    while store.get(job).status not in (JobStatus.FINALIZING, JobStatus.COMPLETED):
        scheduler.run_once()
        assert time.monotonic() < deadline, store.get(job).status
        time.sleep(0.005)
    return sorted(client.result_rows(job), key=lambda row: row["line"])


def test_a_responses_line_completes(queue):
    client, scheduler = queue
    [row] = drain(client, scheduler, client.submit([RESPONSES_LINE], model=MODEL))
    assert (row["status"], row["custom_id"], row["url"], row["model"]) == ("completed", "resp-1",
                                                                          "/v1/responses", MODEL)
    assert row["metadata"] == {"team": "a"} and len(row["output_token_ids"]) == 4


def test_anthropic_lines_complete_from_records_parquet_and_a_direct_request(queue, tmp_path):
    client, scheduler = queue
    [row] = drain(client, scheduler, client.submit([ANTHROPIC_LINE], model=MODEL))
    assert (row["status"], row["custom_id"], row["url"]) == ("completed", "anth-1", "/v1/messages")
    assert row["metadata"] == {"user_id": "u-1"} and len(row["output_token_ids"]) == 4

    # a Parquet file of custom_id + params (JSON text), as the docs describe
    path = tmp_path / "anthropic.parquet"
    pq.write_table(pa.table({"custom_id": ["p-1", "p-2"],
                             "params": [json.dumps(PARAMS), json.dumps({**PARAMS, "max_tokens": 2})]}), path)
    rows = drain(client, scheduler, client.submit(str(path), model=MODEL))
    assert [(r["status"], r["custom_id"], len(r["output_token_ids"])) for r in rows] == [
        ("completed", "p-1", 4), ("completed", "p-2", 2)]

    # a direct request: the client's model goes into params (no model there), not beside it
    line = {"custom_id": "d-1", "params": {k: v for k, v in PARAMS.items() if k != "model"}}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reply = pool.submit(client.request, line, model=MODEL, timeout=60)
        while not reply.done():  # the scheduler is stepped here, as drain() does
            scheduler.run_once()
            time.sleep(0.005)
    direct = reply.result()
    assert (direct.status, direct.custom_id, direct.model) == ("completed", "d-1", MODEL), \
        direct.error_message
