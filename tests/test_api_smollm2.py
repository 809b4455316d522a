"""The HTTP API over the real demo model (SmolLM2-135M-Instruct, ``--model demo``), driven by the
official ``openai`` SDK: a batch of three chat lines through Files and Batches to ``completed``,
and a synchronous chat completion whose text is the one ``Client.request`` gives for the same body
at temperature 0. Scheduler, worker, exporter and ``batchinfer api`` are real subprocesses."""

from __future__ import annotations

import json

import pytest
from openai.types.chat import ChatCompletion

from batchinfer.workers.models.demo import demo_gguf

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

CHAT = "/v1/chat/completions"
MODEL = "demo"
ASKS = {
    "france": [{"role": "user", "content": "What is the capital of France?"}],
    "colors": [{"role": "system", "content": "You answer briefly."},
               {"role": "user", "content": "Name the three primary colors."}],
    "japan": [{"role": "user", "content": "What is the capital of Japan?"}],
}


@pytest.fixture
def stack(redis_server, tmp_path):
    """Scheduler, exporter, a worker of ``--model demo`` (awaited) and replica ``api``."""
    try:
        demo_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    from api_stack import ApiStack

    s = ApiStack(redis_server.url, tmp_path / "stack")
    try:
        s.start("scheduler", "scheduler")
        s.start("exporter", "exporter")
        s.start("worker", "worker", "--name", "worker", "--device", "cpu", "--model", MODEL)
        s.start_api("api")
        s.wait_for_worker("worker")
        yield s
    finally:
        s.close()
        print(s.logs())


def body(messages: list[dict]) -> dict:
    return {"model": MODEL, "messages": messages, "max_tokens": 24, "temperature": 0}


def test_smollm2_batch_and_sync_chat_through_the_openai_sdk(stack):
    client = stack.openai(stack.key("smollm2"))
    lines = "".join(json.dumps({"custom_id": cid, "method": "POST", "url": CHAT, "body": body(m)}) + "\n"
                    for cid, m in ASKS.items())
    f = client.files.create(file=("chats.jsonl", lines.encode()), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
    done = stack.until(lambda: (b := client.batches.retrieve(batch.id)).status in (
        "completed", "failed", "expired", "cancelled") and b, 600, "the batch to end", poll=0.5)
    assert done.status == "completed", (done, stack.logs())
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (3, 3, 0)
    assert done.error_file_id is None and done.model == MODEL
    out = [json.loads(x) for x in client.files.content(done.output_file_id).content.splitlines()]
    assert sorted(line["custom_id"] for line in out) == sorted(ASKS)
    answers = {}
    for line in out:
        assert line["error"] is None and line["response"]["status_code"] == 200, line
        chat = ChatCompletion.model_validate(line["response"]["body"])
        answers[line["custom_id"]] = chat.choices[0].message.content
        assert chat.model == MODEL and chat.usage.completion_tokens <= 24
    assert "Paris" in answers["france"] and "Tokyo" in answers["japan"], answers
    assert answers["colors"].strip(), answers
    assert done.usage.output_tokens > 0 and done.usage.input_tokens > 0

    sync = client.chat.completions.create(**body(ASKS["france"]))
    assert isinstance(sync, ChatCompletion) and sync.model == MODEL
    line = {"custom_id": "same", "method": "POST", "url": CHAT, "body": body(ASKS["france"])}
    row = stack.client.request(line, timeout=300)
    assert row.status == "completed" and sync.choices[0].message.content == row.output_text
    assert "Paris" in row.output_text and sync.choices[0].finish_reason == row.finish_reason
