"""Anthropic Message Batches over HTTP (batchinfer/api/message_batches.py), driven by the official
``anthropic`` SDK against a real ``batchinfer api``, Redis, scheduler, exporter and tiny-model worker;
the pure parts (request checks, the MessageBatch object) without them."""

from __future__ import annotations

import time
from pathlib import Path

import anthropic
import pytest
from anthropic.types.messages import MessageBatch

from batchinfer.api.errors import ApiError
from batchinfer.api.message_batches import message_batch, parse_requests, processing_status
from batchinfer.client.client import JobNotFound
from batchinfer.store.apibatches import ApiBatch, ApiBatches, BatchKind, BatchState
from batchinfer.store.jobstore import JobRecord, JobStatus

MODEL = "tiny-llama"
UNSERVED = "nobody-serves-this"  # requests for it wait in the holding area: they never end by themselves
ENDED_TIMEOUT_S = 120.0


def ask(custom_id: str, text: str = "Hello", model: str = MODEL, **params) -> dict:
    return {"custom_id": custom_id,
            "params": {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": text}],
                       **params}}


def bad(custom_id: str) -> dict:
    """A request the scheduler answers ``errored`` at run time (no max_tokens), with no worker."""
    return {"custom_id": custom_id,
            "params": {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}}


def wait_ended(client: anthropic.Anthropic, batch_id: str, timeout: float = ENDED_TIMEOUT_S) -> MessageBatch:
    deadline = time.monotonic() + timeout
    while True:
        batch = client.messages.batches.retrieve(batch_id)
        if batch.processing_status == "ended":
            return batch
        assert time.monotonic() < deadline, f"{batch_id} still {batch.processing_status} after {timeout} s"
        time.sleep(0.1)


def owner_of(stack, secret: str) -> str:
    return stack.api_keys.authenticate(secret).id


def results_path(stack, secret: str, batch_id: str) -> Path:
    batch = ApiBatches(stack.client.redis, stack.client.keys).get(batch_id, owner_of(stack, secret))
    assert batch is not None and batch.output_file_id is not None
    return stack.tmp / "files" / batch.output_file_id


# -- pure: the create body's checks ----------------------------------------------------------------

def refused(body, limit: int = 100_000) -> str:
    with pytest.raises(ApiError) as info:
        parse_requests(body, limit)
    assert info.value.status == 400
    return info.value.message


def test_requests_are_checked_before_a_batch_exists():
    good = [ask("a"), ask("b-1_X")]
    assert parse_requests({"requests": good}) == good
    message = refused({"requests": [ask("a"), ask("b"), ask("a")]})
    assert "requests[2].custom_id 'a' is a duplicate of requests[0]" in message
    assert "requests[0].custom_id" in refused({"requests": [ask("has space")]})
    assert "requests[0].custom_id" in refused({"requests": [ask("x" * 65)]})
    assert "requests[1].custom_id" in refused({"requests": [ask("a"), {"params": {}}]})
    not_object = {"requests": [{"custom_id": "a", "params": "hi"}]}
    assert "requests[0].params must be an object" in refused(not_object)
    assert "requests[0].extra: unknown field" in refused({"requests": [{**ask("a"), "extra": 1}]})
    assert "requests must be a non-empty list" in refused({"requests": []})
    assert "requests must be a non-empty list" in refused({})
    assert "metadata: unknown field" in refused({"requests": good, "metadata": {}})
    assert "3 requests, over the limit of 2" in refused({"requests": [ask("a"), ask("b"), ask("c")]}, limit=2)
    # the params' contents are the scheduler's to check, one request at a time
    assert parse_requests({"requests": [bad("z")]}) == [bad("z")]


# -- pure: the MessageBatch object -----------------------------------------------------------------

def api_batch(total: int = 5) -> ApiBatch:
    return ApiBatch(id="msgbatch_" + "0" * 24, kind=BatchKind.ANTHROPIC, owner="key_1",
                    endpoint="/v1/messages",
                    input_file_id=None, output_file_id="file-" + "1" * 24, error_file_id=None,
                    completion_window="24h", metadata={}, created_at=1_700_000_000_123,
                    state=BatchState.SUBMITTED, total=total)


def test_message_batch_object_follows_the_job():
    batch = api_batch()
    base = "http://api.example:8000/"
    pending = MessageBatch.model_validate(message_batch(batch, None, base))  # no job record yet
    assert (pending.processing_status, pending.results_url, pending.ended_at) == ("in_progress", None, None)
    assert pending.request_counts.processing == 5 and pending.created_at.year == 2023
    assert pending.expires_at.timestamp() - pending.created_at.timestamp() == pytest.approx(24 * 3600)

    running = JobRecord(id=batch.id, status=JobStatus.IN_PROGRESS, total=5, completed=3, failed=1,
                        created_at=batch.created_at, expires_at=batch.created_at + 1000)
    shown = MessageBatch.model_validate(message_batch(batch, running, base))
    # Anthropic's rule: every request counts as processing until the whole batch ends
    assert shown.request_counts.model_dump() == {"processing": 5, "succeeded": 0, "errored": 0, "canceled": 0,
                                                 "expired": 0}
    running.status, running.completed_at = JobStatus.COMPLETED, batch.created_at + 500
    assert processing_status(running) == "in_progress"  # ended, but its results file is not written yet
    running.exported_at, running.completed = batch.created_at + 600, 4
    ended = MessageBatch.model_validate(message_batch(batch, running, base))
    assert ended.processing_status == "ended"
    assert ended.results_url == f"http://api.example:8000/v1/messages/batches/{batch.id}/results"
    assert ended.request_counts.model_dump() == {"processing": 0, "succeeded": 4, "errored": 1, "canceled": 0,
                                                 "expired": 0}
    assert ended.ended_at.timestamp() == pytest.approx((batch.created_at + 500) / 1000)

    # an export that failed for good leaves the job failed, no file: ended all the same (not polled forever)
    export_failed = JobRecord(id=batch.id, status=JobStatus.FAILED, total=5, completed=5,
                              failed_at=batch.created_at + 700)
    assert processing_status(export_failed) == "ended"

    cancelling = JobRecord(id=batch.id, status=JobStatus.CANCELLING, total=5, completed=1,
                           cancelling_at=batch.created_at + 100)
    shown = MessageBatch.model_validate(message_batch(batch, cancelling, base))
    assert shown.processing_status == "canceling" and shown.cancel_initiated_at is not None
    # an expired job's requests without a row count as expired: the tallies always sum to the total
    expired = JobRecord(id=batch.id, status=JobStatus.EXPIRED, total=5, completed=2, expired=1,
                        expired_at=batch.created_at + 9, exported_at=batch.created_at + 10)
    counts = message_batch(batch, expired, base)["request_counts"]
    assert counts == {"processing": 0, "succeeded": 2, "errored": 0, "canceled": 0, "expired": 3}


# -- through the SDK -------------------------------------------------------------------------------

def test_create_poll_read_results_and_delete(api_stack):
    secret = api_stack.key("alice")
    client = api_stack.anthropic(secret)
    api_stack.wait_for_model()
    created = client.messages.batches.create(requests=[ask("greet"), bad("broken"), ask("count", "1 2 3")])
    assert created.id.startswith("msgbatch_") and created.type == "message_batch"
    assert created.processing_status in ("in_progress", "ended")
    if created.processing_status == "in_progress":
        assert created.request_counts.processing == 3 and created.results_url is None
    ended = wait_ended(client, created.id)
    assert ended.request_counts.model_dump() == {"processing": 0, "succeeded": 2, "errored": 1, "canceled": 0,
                                                 "expired": 0}
    assert ended.ended_at is not None and ended.ended_at >= ended.created_at and ended.archived_at is None
    assert ended.results_url == f"{api_stack.root_url}/v1/messages/batches/{created.id}/results"

    results = {r.custom_id: r.result for r in client.messages.batches.results(created.id)}
    assert sorted(results) == ["broken", "count", "greet"]
    for name in ("greet", "count"):
        assert results[name].type == "succeeded"
        message = results[name].message
        assert message.model == MODEL and message.role == "assistant"
        assert message.usage.output_tokens <= 4 and message.stop_reason in ("max_tokens", "end_turn")
    assert results["broken"].type == "errored"
    assert results["broken"].error.error.type == "invalid_request_error"
    assert "max_tokens" in results["broken"].error.error.message

    # the job's record holds the key as its tenant (fair share)
    assert api_stack.client.status(created.id).tenant == owner_of(api_stack, secret)
    path = results_path(api_stack, secret, created.id)
    assert path.is_file()
    deleted = client.messages.batches.delete(created.id)
    assert (deleted.id, deleted.type) == (created.id, "message_batch_deleted")
    assert not path.exists()  # its results' bytes went with it
    with pytest.raises(JobNotFound):
        api_stack.client.status(created.id)
    with pytest.raises(anthropic.NotFoundError):
        client.messages.batches.retrieve(created.id)
    with pytest.raises(anthropic.NotFoundError):
        client.get(f"/v1/messages/batches/{created.id}/results", cast_to=object)
    assert created.id not in [b.id for b in client.messages.batches.list()]


def test_cancel_mid_run_and_delete_only_once_ended(api_stack):
    client = api_stack.anthropic(api_stack.key("bob"))
    # two requests no worker will ever answer (held for their model) keep the batch running
    held = client.messages.batches.create(requests=[ask("h1", model=UNSERVED), ask("h2", model=UNSERVED),
                                                    bad("b1")])
    running = client.messages.batches.retrieve(held.id)
    assert running.processing_status == "in_progress" and running.request_counts.processing == 3
    with pytest.raises(anthropic.BadRequestError, match="only an ended batch can be deleted"):
        client.messages.batches.delete(held.id)
    with pytest.raises(anthropic.BadRequestError, match="available once it has ended"):
        client.get(f"/v1/messages/batches/{held.id}/results", cast_to=object)
    with pytest.raises(anthropic.AnthropicError, match="results_url"):
        client.messages.batches.results(held.id)  # the SDK itself refuses: no results_url yet

    cancelled = client.messages.batches.cancel(held.id)
    assert cancelled.processing_status in ("canceling", "ended") and cancelled.cancel_initiated_at is not None
    ended = wait_ended(client, held.id)
    assert ended.request_counts.model_dump() == {"processing": 0, "succeeded": 0, "errored": 1, "canceled": 2,
                                                 "expired": 0}
    assert ended.cancel_initiated_at is not None and ended.ended_at >= ended.cancel_initiated_at
    kinds = {r.custom_id: r.result.type for r in client.messages.batches.results(held.id)}
    assert kinds == {"h1": "canceled", "h2": "canceled", "b1": "errored"}
    assert client.messages.batches.cancel(held.id).processing_status == "ended"  # as it is, once ended
    assert client.messages.batches.delete(held.id).type == "message_batch_deleted"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.batches.delete(held.id)


def test_refusals_pagination_and_keys_that_cannot_see_each_other(api_stack):
    alice, bob = api_stack.anthropic(api_stack.key("alice")), api_stack.anthropic(api_stack.key("bob"))
    duplicate = r"requests\[2\]\.custom_id 'a' is a duplicate of requests\[0\]"
    with pytest.raises(anthropic.BadRequestError, match=duplicate) as info:
        alice.messages.batches.create(requests=[bad("a"), bad("b"), bad("a")])
    assert info.value.body["error"]["type"] == "invalid_request_error"  # Anthropic's error shape
    with pytest.raises(anthropic.BadRequestError, match="custom_id"):
        alice.messages.batches.create(requests=[bad("no/slashes")])
    assert list(alice.messages.batches.list()) == []  # nothing was created

    ids = [alice.messages.batches.create(requests=[bad(f"r{i}")]).id for i in range(5)]
    newest_first = ids[::-1]
    page = alice.messages.batches.list(limit=2)
    assert [b.id for b in page.data] == newest_first[:2] and page.has_more
    assert (page.first_id, page.last_id) == (newest_first[0], newest_first[1])
    assert [b.id for b in alice.messages.batches.list(limit=2)] == newest_first  # the SDK pages by after_id
    older = alice.messages.batches.list(after_id=newest_first[1], limit=2)
    assert [b.id for b in older.data] == newest_first[2:4] and older.has_more
    newer = alice.messages.batches.list(before_id=newest_first[3], limit=2)
    assert [b.id for b in newer.data] == newest_first[1:3] and newer.has_more
    last = alice.messages.batches.list(before_id=newest_first[1], limit=2)
    assert [b.id for b in last.data] == newest_first[:1] and not last.has_more
    for limit in (0, 1001):
        with pytest.raises(anthropic.BadRequestError, match="limit"):
            alice.messages.batches.list(limit=limit)

    # bob sees none of alice's batches, and cannot act on them: 404, never their contents
    theirs = ids[0]
    assert list(bob.messages.batches.list()) == []
    for call in (bob.messages.batches.retrieve, bob.messages.batches.cancel, bob.messages.batches.delete):
        with pytest.raises(anthropic.NotFoundError) as info:
            call(theirs)
        assert info.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.NotFoundError):
        bob.get(f"/v1/messages/batches/{theirs}/results", cast_to=object)
    assert list(bob.messages.batches.list(after_id=theirs)) == []  # a cursor of another key's: nothing
    wait_ended(alice, theirs)  # still alice's, untouched
    with pytest.raises(anthropic.NotFoundError):
        alice.messages.batches.retrieve("msgbatch_" + "f" * 24)


def test_requests_queued_per_key_are_limited(api_stack):
    carol = api_stack.anthropic(api_stack.key("carol", max_queued_requests=3))
    first = carol.messages.batches.create(requests=[ask("h1", model=UNSERVED), ask("h2", model=UNSERVED)])
    with pytest.raises(anthropic.RateLimitError, match="2 requests queued") as info:
        carol.messages.batches.create(requests=[ask("h3", model=UNSERVED), ask("h4", model=UNSERVED)])
    assert info.value.body["error"]["type"] == "rate_limit_error"
    # what carol has queued does not count against another key's limit
    dave = api_stack.anthropic(api_stack.key("dave", max_queued_requests=3))
    assert dave.messages.batches.create(requests=[bad("a"), bad("b"), bad("c")]).id.startswith("msgbatch_")
    # once carol's batch has ended, her requests no longer count
    carol.messages.batches.cancel(first.id)
    wait_ended(carol, first.id)
    assert carol.messages.batches.create(requests=[bad("a"), bad("b"), bad("c")]).id.startswith("msgbatch_")
