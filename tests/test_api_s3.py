"""The HTTP API with its file store on an S3-compatible server (moto's, tests/s3_server.py), end to end.

Every daemon runs with ``BATCHINFER_FILES_DIR=s3://<bucket>/<prefix>`` and the AWS variables that
reach the server: the API streams uploads into the bucket and serves downloads from it, and the
exporter writes the batches' result files there with pyarrow. The official ``openai`` and
``anthropic`` SDKs drive it; the bucket's own listing (boto3) shows what is really stored.
"""

from __future__ import annotations

import json
import time
import uuid

import anthropic
import openai
import pytest
from openai.types.chat import ChatCompletion

from batchinfer.store.apibatches import ApiBatches

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
TINY = "tiny-llama"  # the tiny_llama fixture's served name
PREFIX = "batchinfer/files"  # the file store's folder inside the bucket
TERMINAL = ("completed", "failed", "expired", "cancelled")


@pytest.fixture(scope="module")
def bucket(s3_server) -> str:
    """A fresh bucket on the S3 server: its name."""
    name = f"files-{uuid.uuid4().hex[:12]}"
    s3_server.make_bucket(name)
    return name


@pytest.fixture(scope="module")
def s3_stack(redis_module, s3_server, bucket, tmp_path_factory, tiny_llama):
    """Scheduler, exporter, a tiny-llama worker and ``batchinfer api``, the file store in ``bucket``."""
    from api_stack import ApiStack

    s = ApiStack(redis_module.url, tmp_path_factory.mktemp("api-s3"), tiny_llama,
                 env={**s3_server.env(), "BATCHINFER_FILES_DIR": f"s3://{bucket}/{PREFIX}"})
    try:
        s.start_all()
        s.wait_for_model()
        yield s
    finally:
        s.close()
        print(s.logs())


def stored(s3_server, bucket: str) -> set[str]:
    """The object keys under the store's prefix in ``bucket``."""
    return {k for k in s3_server.object_keys(bucket) if k.startswith(PREFIX + "/")}


def chat_line(custom_id: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": CHAT,
            "body": {"model": TINY, "messages": [{"role": "user", "content": f"say {custom_id}"}],
                     "max_tokens": 4, **body}}


def file_lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    assert file_id is not None
    return [json.loads(x) for x in client.files.content(file_id).content.decode().splitlines()]


def test_an_openai_batch_reads_and_writes_its_files_in_the_bucket(s3_stack, s3_server, bucket):
    client = s3_stack.openai(s3_stack.key("s3-openai"))
    # the last line passes validation, but the scheduler refuses its body: a line of the error file
    lines = [chat_line(f"ok-{i}") for i in range(3)] + [chat_line("bad", bogus_param=1)]
    data = "".join(json.dumps(x) + "\n" for x in lines).encode()
    uploaded = client.files.create(file=("input.jsonl", data), purpose="batch")
    assert uploaded.bytes == len(data)
    assert f"{PREFIX}/{uploaded.id}" in stored(s3_server, bucket)
    assert not (s3_stack.tmp / "files").exists()  # nothing went to the stack's local folder
    assert client.files.content(uploaded.id).content == data  # served back from the bucket

    batch = client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
    done = s3_stack.until(lambda: (b := client.batches.retrieve(batch.id)).status in TERMINAL and b, 120,
                          f"batch {batch.id} ended", poll=0.2)
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (4, 3, 1)
    assert done.output_file_id and done.error_file_id
    # the exporter wrote both result files into the bucket, under the store's prefix
    keys = stored(s3_server, bucket)
    assert {f"{PREFIX}/{done.output_file_id}", f"{PREFIX}/{done.error_file_id}"} <= keys

    outputs = file_lines(client, done.output_file_id)
    assert sorted(x["custom_id"] for x in outputs) == [f"ok-{i}" for i in range(3)]
    for x in outputs:
        assert x["error"] is None and x["response"]["status_code"] == 200
        completion = ChatCompletion.model_validate(x["response"]["body"])
        assert completion.model == TINY and completion.choices[0].message.role == "assistant"
    (error,) = file_lines(client, done.error_file_id)
    assert error["custom_id"] == "bad" and error["response"] is None
    assert "bogus_param" in error["error"]["message"]
    output = client.files.retrieve(done.output_file_id)
    assert output.purpose == "batch_output" and output.bytes == len(client.files.content(output.id).content)

    # DELETE removes the object from the bucket, for an upload and for a result file alike
    for file_id in (uploaded.id, done.output_file_id):
        assert client.files.delete(file_id).deleted is True
        assert f"{PREFIX}/{file_id}" not in stored(s3_server, bucket)
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(file_id)
    assert f"{PREFIX}/{done.error_file_id}" in stored(s3_server, bucket)  # only what was deleted went


def test_an_anthropic_message_batch_ends_with_its_results_in_the_bucket(s3_stack, s3_server, bucket):
    secret = s3_stack.key("s3-anthropic")
    client = s3_stack.anthropic(secret)
    ask = {"model": TINY, "max_tokens": 4, "messages": [{"role": "user", "content": "Hello"}]}
    no_max_tokens = {"model": TINY, "messages": [{"role": "user", "content": "x"}]}  # errored at run time
    created = client.messages.batches.create(requests=[{"custom_id": "greet", "params": ask},
                                                       {"custom_id": "broken", "params": no_max_tokens}])
    deadline = time.monotonic() + 120
    while (ended := client.messages.batches.retrieve(created.id)).processing_status != "ended":
        assert time.monotonic() < deadline, f"{created.id} still {ended.processing_status}\n{s3_stack.logs()}"
        time.sleep(0.1)
    assert (ended.request_counts.succeeded, ended.request_counts.errored) == (1, 1)

    owner = s3_stack.api_keys.authenticate(secret).id
    batch = ApiBatches(s3_stack.client.redis, s3_stack.client.keys).get(created.id, owner)
    assert batch is not None and batch.output_file_id is not None
    results_key = f"{PREFIX}/{batch.output_file_id}"
    assert results_key in stored(s3_server, bucket)

    results = {r.custom_id: r.result for r in client.messages.batches.results(created.id)}
    assert sorted(results) == ["broken", "greet"]
    assert results["greet"].type == "succeeded" and results["greet"].message.model == TINY
    assert results["broken"].type == "errored" and "max_tokens" in results["broken"].error.error.message

    assert client.messages.batches.delete(created.id).type == "message_batch_deleted"
    assert results_key not in stored(s3_server, bucket)  # its results' bytes went with it
    with pytest.raises(anthropic.NotFoundError):
        client.messages.batches.retrieve(created.id)
