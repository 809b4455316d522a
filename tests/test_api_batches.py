"""OpenAI's Batch API (batchinfer/api/batches_routes.py, jobs/api_batches.py) through the official
openai SDK against real daemons: upload -> create -> poll -> download the output and error files;
validation failures; cancel (while validating and mid-run); expiry; listing; per-key isolation."""

from __future__ import annotations

import json
import uuid

import openai
import pytest
from openai.types import Batch
from openai.types.chat import ChatCompletion
from openai.types.completion import Completion
from rq.job import Job
from rq.serializers import JSONSerializer

from batchinfer.jobs.queueing import rq_job_id

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
TINY = "tiny-llama"  # the tiny_llama fixture's served name
# an echo worker that finishes one request every 0.25 s: batches run long enough to cancel or expire
SLOW_ECHO = {"step_delay": 0.25, "requests_per_step": 1, "max_num_seqs": 2}
TERMINAL = ("completed", "failed", "expired", "cancelled")


@pytest.fixture(scope="module")
def stack(redis_module, tmp_path_factory, tiny_llama):
    """Scheduler, exporter, a tiny-llama worker, a slow echo worker and ``batchinfer api``."""
    from api_stack import ApiStack

    s = ApiStack(redis_module.url, tmp_path_factory.mktemp("batches-api"), tiny_llama)
    try:
        s.start_all()
        s.worker("echo", echo=True, options=SLOW_ECHO)
        s.wait_for_model()
        s.wait_for_worker("echo")
        yield s
    finally:
        s.close()
        print(s.logs())


def new_client(stack, **limits) -> openai.OpenAI:
    return stack.openai(stack.key(f"k-{uuid.uuid4().hex[:8]}", **limits))


def chat_line(custom_id: str, model: str = TINY, url: str = CHAT, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url,
            "body": {"model": model, "messages": [{"role": "user", "content": f"say {custom_id}"}],
                     "max_tokens": 4, **body}}


def upload(client: openai.OpenAI, lines: list, name: str = "input.jsonl") -> str:
    data = "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()
    return client.files.create(file=(name, data), purpose="batch").id


def wait(stack, client: openai.OpenAI, batch_id: str, until=TERMINAL, timeout: float = 120) -> Batch:
    return stack.until(lambda: (b := client.batches.retrieve(batch_id)).status in until and b, timeout,
                       f"batch {batch_id} {' or '.join(until)}", poll=0.2)


def file_lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    assert file_id is not None
    return [json.loads(x) for x in client.files.content(file_id).content.decode().splitlines()]


def test_a_batch_runs_to_completion_with_its_output_and_error_files(stack):
    client = new_client(stack)
    # the last line passes validation, but the scheduler refuses its body: a line of the error file
    lines = [chat_line(f"ok-{i}") for i in range(4)] + [chat_line("bad", bogus_param=1)]
    file_id = upload(client, lines)
    batch = client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h",
                                  metadata={"run": "one"})
    assert batch.status == "validating" and batch.input_file_id == file_id
    assert batch.metadata == {"run": "one"}
    done = wait(stack, client, batch.id)
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (5, 4, 1)
    assert done.in_progress_at and done.finalizing_at and done.completed_at and done.expires_at
    assert done.model == TINY and done.usage is not None and done.usage.input_tokens > 0
    assert done.usage.total_tokens == done.usage.input_tokens + done.usage.output_tokens
    assert done.errors is None

    outputs = file_lines(client, done.output_file_id)
    assert sorted(x["custom_id"] for x in outputs) == [f"ok-{i}" for i in range(4)]
    for x in outputs:
        assert x["error"] is None and x["response"]["status_code"] == 200
        completion = ChatCompletion.model_validate(x["response"]["body"])
        assert completion.model == TINY and completion.choices[0].message.role == "assistant"
    (error,) = file_lines(client, done.error_file_id)
    assert error["custom_id"] == "bad" and error["response"] is None
    assert error["error"]["code"] and "bogus_param" in error["error"]["message"]
    assert error["error"]["line"] == 5
    assert client.files.retrieve(done.output_file_id).purpose == "batch_output"
    assert stack.client.status(batch.id).tenant is not None  # the key's jobs are its tenant


def test_a_batch_without_errors_has_no_error_file(stack):
    client = new_client(stack)
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": TINY, "prompt": "hello", "max_tokens": 3}} for i in range(3)]
    batch = client.batches.create(input_file_id=upload(client, lines), endpoint="/v1/completions",
                                  completion_window="1h")
    done = wait(stack, client, batch.id)
    assert done.status == "completed" and done.error_file_id is None and done.completion_window == "1h"
    outputs = file_lines(client, done.output_file_id)
    assert len(outputs) == 3 and all(Completion.model_validate(x["response"]["body"]) for x in outputs)


def test_an_invalid_file_fails_the_batch_with_its_lines(stack):
    client = new_client(stack)
    lines = [chat_line("a"), chat_line("b", url="/v1/completions"), chat_line("a"), "{not json"]
    batch = client.batches.create(input_file_id=upload(client, lines), endpoint=CHAT, completion_window="24h")
    failed = wait(stack, client, batch.id)
    assert failed.status == "failed" and failed.failed_at and failed.output_file_id is None
    assert [(e.code, e.line, e.param) for e in failed.errors.data] == [
        ("url_mismatch", 2, "url"), ("duplicate_custom_id", 3, "custom_id"), ("invalid_json_line", 4, None)]
    assert stack.client.store.get(batch.id) is None  # nothing was submitted


def test_create_refuses_bad_arguments(stack):
    client = new_client(stack)
    file_id = upload(client, [chat_line("a")])
    other = client.files.create(file=("u.jsonl", b"{}\n"), purpose="user_data").id
    cases = [
        (dict(input_file_id=file_id, endpoint="/v1/moderations"), "endpoint"),
        (dict(input_file_id=other, endpoint=CHAT), "input_file_id"),
        (dict(input_file_id="file-" + "0" * 24, endpoint=CHAT), "input_file_id"),
        (dict(input_file_id=file_id, endpoint=CHAT, completion_window="soon"), "completion_window"),
        (dict(input_file_id=file_id, endpoint=CHAT, metadata={str(i): "v" for i in range(17)}), "metadata"),
        (dict(input_file_id=file_id, endpoint=CHAT, metadata={"k": "v" * 513}), "metadata.k"),
    ]
    for kwargs, param in cases:
        kwargs.setdefault("completion_window", "24h")
        with pytest.raises(openai.BadRequestError) as e:
            client.batches.create(**kwargs)
        assert e.value.body["param"] == param, (kwargs, e.value.body)
    assert list(client.batches.list()) == []


def test_cancel_mid_run_keeps_the_partial_output(stack):
    client = new_client(stack)
    n = 40
    batch = client.batches.create(input_file_id=upload(client, [chat_line(f"e{i}", model="echo")
                                                               for i in range(n)]),
                                  endpoint=CHAT, completion_window="24h")
    wait(stack, client, batch.id, until=("in_progress",))
    stack.until(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 2, 60,
                "2 requests done")
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    done = wait(stack, client, batch.id)
    assert done.status == "cancelled" and done.cancelling_at and done.cancelled_at
    counts = done.request_counts
    assert 2 <= counts.completed < n and counts.completed + counts.failed == n
    outputs, errors = file_lines(client, done.output_file_id), file_lines(client, done.error_file_id)
    assert len(outputs) == counts.completed and len(errors) == counts.failed
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert client.batches.cancel(batch.id).status == "cancelled"  # an ended batch stays as it is


def test_a_batch_past_its_window_expires_with_partial_output(stack):
    client = new_client(stack)
    # 40 s of work for the slow echo worker: the 20 s window closes first, with some done (the batch
    # start, intake and dispatch come before the first row: a loaded machine once took 6 s for them).
    # The cancel before leaves deleted unread batches on the echo stream: CI twice finished none here
    # while dispatch trusted Redis's lag, which stays too high after those (dispatch.undelivered).
    n = 160
    batch = client.batches.create(input_file_id=upload(client, [chat_line(f"x{i}", model="echo")
                                                               for i in range(n)]),
                                  endpoint=CHAT, completion_window="20s")  # a duration, not only "24h"
    done = wait(stack, client, batch.id)
    assert done.status == "expired" and done.expired_at, done
    counts = done.request_counts
    if counts.completed < 1:  # keep the daemons' story
        print(stack.logs()[-8000:])
    assert 1 <= counts.completed < n and counts.completed + counts.failed == n, done  # its timestamps
    assert len(file_lines(client, done.output_file_id)) == counts.completed
    errors = file_lines(client, done.error_file_id)
    assert len(errors) == counts.failed and "batch_expired" in {e["error"]["code"] for e in errors}


def test_cancel_while_validating_submits_nothing(stack):
    client = new_client(stack)
    file_id = upload(client, [chat_line("a")])
    stack.stop("exporter")  # start_batch runs on the exporter: the batch stays validating
    try:
        batch = client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
        cancelled = client.batches.cancel(batch.id)
        assert cancelled.status == "cancelled" and cancelled.cancelled_at
    finally:
        stack.start("exporter-2", "exporter")
    # the queued start runs now, finds the batch cancelled and submits nothing
    start = Job.fetch(rq_job_id("start", stack.prefix, batch.id), connection=stack.client.redis,
                      serializer=JSONSerializer)
    stack.until(lambda: start.get_status(refresh=True) == "finished", 60, "the start job ran")
    assert start.return_value() == "batch is cancelled"
    assert stack.client.store.get(batch.id) is None
    assert client.batches.retrieve(batch.id).status == "cancelled"


def test_the_keys_queued_requests_limit_fails_a_batch(stack):
    client = new_client(stack, max_queued_requests=40)
    first = client.batches.create(input_file_id=upload(client, [chat_line(f"q{i}", model="echo")
                                                               for i in range(40)]),
                                  endpoint=CHAT, completion_window="24h")  # 10 s of slow echo work
    wait(stack, client, first.id, until=("in_progress",))
    second = client.batches.create(input_file_id=upload(client, [chat_line(f"r{i}") for i in range(5)]),
                                   endpoint=CHAT, completion_window="24h")
    failed = wait(stack, client, second.id)
    assert failed.status == "failed" and [e.code for e in failed.errors.data] == ["request_limit_exceeded"]
    assert "40" in failed.errors.data[0].message
    client.batches.cancel(first.id)
    assert wait(stack, client, first.id).status == "cancelled"


def test_list_pages_newest_first(stack):
    client = new_client(stack)
    file_id = upload(client, ["not json"])  # batches that fail at once: only their listing matters here
    ids = [client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h").id
           for _ in range(3)]
    page = client.batches.list(limit=2)
    assert [b.id for b in page.data] == ids[::-1][:2] and page.has_more
    rest = client.batches.list(limit=2, after=page.data[-1].id)
    assert [b.id for b in rest.data] == [ids[0]] and not rest.has_more
    assert [b.id for b in client.batches.list(limit=1)] == ids[::-1]  # the SDK follows `after`
    for limit in (0, 101):
        with pytest.raises(openai.BadRequestError):
            client.batches.list(limit=limit)


def test_keys_cannot_see_each_others_batches(stack):
    alice, bob = new_client(stack), new_client(stack)
    file_id = upload(alice, ["not json"])
    batch = alice.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
    for call in (bob.batches.retrieve, bob.batches.cancel):
        with pytest.raises(openai.NotFoundError) as e:
            call(batch.id)
        assert file_id not in e.value.response.text
    assert list(bob.batches.list()) == []
    with pytest.raises(openai.BadRequestError):
        bob.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
    assert alice.batches.retrieve(batch.id).id == batch.id


# -- the start job alone, on a Redis of its own (no daemons) -------------------------------------------


@pytest.fixture
def local(redis_server, tmp_path, monkeypatch):
    """A file store and batch records on a fresh Redis, with the environment ``start_batch`` reads."""
    from batchinfer.config import Settings
    from batchinfer.keys import Keys
    from batchinfer.store.apibatches import ApiBatches
    from batchinfer.store.filestore import FileStore

    monkeypatch.setenv("BATCHINFER_FILES_DIR", str(tmp_path / "files"))
    monkeypatch.setenv("BATCHINFER_RESULTS_ROOT", str(tmp_path / "results"))
    monkeypatch.setenv("BATCHINFER_REDIS_URL", redis_server.url)
    settings = Settings.from_env(prefix="{t}")
    r, keys = redis_server.client(), Keys(settings.prefix)
    return settings, FileStore(r, keys, settings), ApiBatches(r, keys)


def local_batch(local, lines: list) -> str:
    from batchinfer.store.apibatches import ApiBatch, BatchKind

    settings, files, batches = local
    with files.upload("key_a", "in.jsonl", "batch", max_bytes=1 << 20) as up:
        up.write("".join(json.dumps(x) + "\n" for x in lines).encode())
        source = up.commit()
    batch_id = batches.new_id(BatchKind.OPENAI)
    out, err = files.new_id(), files.new_id()
    files.add_output(out, "key_a", "out.jsonl")
    files.add_output(err, "key_a", "err.jsonl")
    batches.create(ApiBatch(id=batch_id, kind=BatchKind.OPENAI, owner="key_a", endpoint=CHAT,
                            input_file_id=source.id, output_file_id=out, error_file_id=err,
                            completion_window="1h", metadata={"m": "1"}, created_at=1))
    return batch_id


def test_start_batch_submits_once_and_resumes_a_start_that_died(local, redis_server):
    from batchinfer.api.batch_start import start_batch
    from batchinfer.store.apibatches import BatchState
    from batchinfer.store.jobstore import JobStore

    settings, files, batches = local
    jobs = JobStore(redis_server.client(), files.keys)
    batch_id = local_batch(local, [chat_line("a"), chat_line("b")])
    assert start_batch(batch_id, prefix=settings.prefix, redis_url=redis_server.url) == "submitted"
    job = jobs.get(batch_id)
    batch = batches.get(batch_id, "key_a")
    assert batch.state is BatchState.SUBMITTED and batch.total == 2
    assert job.total == 2 and job.model == TINY and job.tenant == "key_a" and job.output_format == "openai"
    assert job.output == files.location(batch.output_file_id)
    assert job.error_output == files.location(batch.error_file_id)
    assert job.completion_window == 3600 and job.metadata == {"m": "1"} and job.input_name == "in.jsonl"
    assert start_batch(batch_id, prefix=settings.prefix, redis_url=redis_server.url) == "submitted already"

    died = local_batch(local, [chat_line("c")])  # marked submitted, then the run died before the job
    assert batches.set_state(died, BatchState.SUBMITTED, total=1)
    assert start_batch(died, prefix=settings.prefix, redis_url=redis_server.url) == "submitted"
    assert jobs.get(died).total == 1


def test_start_batch_leaves_a_cancelled_batch_and_fails_one_whose_file_is_gone(local, redis_server):
    from batchinfer.api.batch_start import start_batch
    from batchinfer.store.apibatches import BatchState

    settings, files, batches = local
    cancelled = local_batch(local, [chat_line("a")])
    assert batches.set_state(cancelled, BatchState.CANCELLED)
    assert start_batch(cancelled, prefix=settings.prefix, redis_url=redis_server.url) == "batch is cancelled"
    assert redis_server.client().exists(files.keys.job(cancelled)) == 0

    gone = local_batch(local, [chat_line("a")])
    assert files.delete(batches.get(gone, "key_a").input_file_id, "key_a")
    assert start_batch(gone, prefix=settings.prefix, redis_url=redis_server.url) == "failed"
    batch = batches.get(gone, "key_a")
    assert batch.state is BatchState.FAILED and [e["code"] for e in batch.errors] == ["file_not_found"]
