"""Faults of the HTTP API (issue 30): replicas of ``batchinfer api`` killed, stopped and restarted
while the SDKs use them, with the scheduler, the exporter and two slow echo workers as real
subprocesses (tests/api_stack.py).

1. A replica SIGKILLed mid-upload leaves no half file: another replica lists nothing, the file
   store's root holds no visible object, Redis no record; the hidden temporary is swept.
2. A batch created on replica A (``api``) is read, downloaded and cancelled through replica B
   (``api2``), and completes while A is stopped.
3. The API killed (SIGKILL) and stopped (SIGTERM) mid-batch, then started again: the batch
   completes with every line answered exactly once.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
from daemons import FAULT_ENV, SLOW_ECHO, stream_rows

from batchinfer.config import Settings
from batchinfer.store.filestore import STALE_TEMP_SECONDS, FileStore

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CHAT = "/v1/chat/completions"
ENDED = ("completed", "failed", "expired", "cancelled")
BATCH_TIMEOUT_S = 180


@pytest.fixture
def stack(redis_server, tmp_path):
    """An :class:`api_stack.ApiStack` with short leases: scheduler, exporter, two slow echo workers
    (``a``, ``b``: a batch of a few hundred lines runs for seconds) and replica ``api``."""
    from api_stack import ApiStack

    s = ApiStack(redis_server.url, tmp_path / "stack", env=FAULT_ENV)
    try:
        s.start("scheduler", "scheduler")
        s.start("exporter", "exporter")
        for name in ("a", "b"):
            s.worker(name, echo=True, options=SLOW_ECHO)
        s.start_api("api")
        s.wait_for_workers(2)
        yield s
    finally:
        s.close()
        print(s.logs())


def batch_file(n: int, tag: str = "r") -> bytes:
    """``n`` OpenAI chat lines for the echo model, custom ids ``<tag>0`` .. ``<tag><n-1>``."""
    return b"".join(json.dumps({
        "custom_id": f"{tag}{i}", "method": "POST", "url": CHAT,
        "body": {"model": "echo", "messages": [{"role": "user", "content": f"request {i:03d}"}],
                 "max_tokens": 3}}).encode() + b"\n" for i in range(n))


def new_key(stack, name: str):
    """(secret, ApiKey) of a fresh key."""
    return stack.api_keys.create(f"{name}-{uuid.uuid4().hex[:6]}")


def wait_batch(stack, client, batch_id: str, until, what: str, timeout: float = BATCH_TIMEOUT_S):
    """Poll ``client.batches.retrieve`` until ``until(batch)``; the batch."""
    return stack.until(lambda: (b := client.batches.retrieve(batch_id)) and until(b) and b, timeout,
                       f"batch {batch_id}: {what}", poll=0.2)


def file_lines(client, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).content.splitlines()]


def answered_once(stack, client, batch, n: int, tag: str = "r") -> tuple[list[dict], list[dict]]:
    """The batch's output and error lines: together one line per input line, none twice; and one
    row per request on its job's results stream (the job id is the batch id)."""
    out, err = file_lines(client, batch.output_file_id), file_lines(client, batch.error_file_id)
    ids = Counter(line["custom_id"] for line in out + err)
    assert len(out) + len(err) == n, (len(out), len(err), stack.logs())
    assert set(ids) == {f"{tag}{i}" for i in range(n)} and max(ids.values()) == 1, ids.most_common(3)
    rows = stream_rows(stack, batch.id)
    assert sorted(r["idx"] for r in rows) == list(range(n)), "a request published twice or never"
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (n, len(out), len(err)), counts
    return out, err


# -- 1. killed mid-upload -------------------------------------------------------------------------------


def visible(folder: Path) -> list[str]:
    """Names in the file store's root a reader could take for a file (hidden temporaries aside)."""
    return sorted(n for n in os.listdir(folder) if not n.startswith(".")) if folder.exists() else []


def sizes(folder: Path) -> dict[str, int]:
    """Every name in the store's root (hidden or not) -> its bytes."""
    return {n: (folder / n).stat().st_size for n in os.listdir(folder)} if folder.exists() else {}


def temporaries(folder: Path) -> dict[str, int]:
    """Hidden upload temporaries in the store's root: name -> bytes written so far."""
    if not folder.exists():
        return {}
    return {n: (folder / n).stat().st_size for n in os.listdir(folder) if n.startswith(".file-")}


def start_partial_upload(port: int, secret: str, sent_bytes: int, declared_bytes: int) -> socket.socket:
    """A raw ``POST /v1/files`` that declares ``declared_bytes`` of file and sends ``sent_bytes`` of it
    (the purpose, the file part's headers, then part of its bytes); the connection stays open."""
    boundary = "fault" + uuid.uuid4().hex
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"big.jsonl\"\r\n"
            f"Content-Type: application/octet-stream\r\n\r\n").encode()
    tail = f"\r\n--{boundary}--\r\n".encode()
    request = (f"POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {secret}\r\n"
               f"Content-Type: multipart/form-data; boundary={boundary}\r\n"
               f"Content-Length: {len(head) + declared_bytes + len(tail)}\r\n\r\n").encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(request + head)
    line = b'{"custom_id": "x", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'
    chunk = line * (65536 // len(line))
    done = 0
    while done < sent_bytes:
        sock.sendall(chunk)
        done += len(chunk)
    return sock


def test_a_replica_killed_mid_upload_leaves_no_half_file(stack):
    other = stack.start_api("api2")
    secret, key = new_key(stack, "uploader")
    folder = stack.tmp / "files"
    assert stack.openai(secret, url=other).files.list().data == [] and visible(folder) == []
    sock = start_partial_upload(stack.ports["api"], secret, sent_bytes=3 << 20, declared_bytes=64 << 20)
    try:
        # the replica is mid-upload once its bytes reach the store (a write per MiB received)
        stack.until(lambda: any(size >= 1 << 20 for size in sizes(folder).values()), 30,
                    "the upload's first bytes in the store")
        stack.kill("api")
    finally:
        sock.close()

    client = stack.openai(secret, url=other)
    assert client.files.list().data == [], "a half upload is listed"
    assert visible(folder) == [], f"a half upload is visible in the store: {visible(folder)}"
    r, keys = stack.client.redis, stack.client.keys
    assert r.zcard(keys.files(key.id)) == 0 and list(r.scan_iter(match=keys.file("*"))) == []
    left = temporaries(folder)
    assert len(left) == 1 and all(n.endswith(".tmp") for n in left), left  # hidden, never served
    # the sweep reclaims what the dead process left, once it is stale
    settings = Settings(redis_url=stack.redis_url, prefix=stack.prefix, files_dir=str(folder))
    FileStore(r, keys, settings).sweep_expired(now_s=int(time.time()) + STALE_TEMP_SECONDS + 60)
    assert temporaries(folder) == {}

    # the same store takes a whole upload through the other replica: it shows where the half did not
    data = batch_file(40)
    f = client.files.create(file=("whole.jsonl", data), purpose="batch")
    assert [x.id for x in client.files.list().data] == [f.id] and visible(folder) == [f.id]
    assert client.files.content(f.id).content == data


# -- 2. created on one replica, served by another ---------------------------------------------------------


def test_a_batch_created_on_one_replica_is_served_by_another(stack):
    url_b = stack.start_api("api2")
    secret, _ = new_key(stack, "two-replicas")
    on_a, on_b = stack.openai(secret), stack.openai(secret, url=url_b)
    n, m = 40, 400
    small = on_a.files.create(file=("small.jsonl", batch_file(n)), purpose="batch")
    large = on_a.files.create(file=("large.jsonl", batch_file(m, tag="l")), purpose="batch")
    done_batch = on_a.batches.create(input_file_id=small.id, endpoint=CHAT, completion_window="24h",
                                     metadata={"replica": "a"})
    cancel_batch = on_a.batches.create(input_file_id=large.id, endpoint=CHAT, completion_window="24h")
    stack.stop("api")  # A is gone for the rest of the test

    seen = on_b.batches.retrieve(done_batch.id)
    assert (seen.id, seen.input_file_id, seen.metadata) == (done_batch.id, small.id, {"replica": "a"})
    assert {b.id for b in on_b.batches.list().data} == {done_batch.id, cancel_batch.id}
    assert {f.id for f in on_b.files.list().data} >= {small.id, large.id}
    assert on_b.files.content(small.id).content == batch_file(n)

    wait_batch(stack, on_b, cancel_batch.id, lambda b: b.status == "in_progress", "in progress")
    cancelling = on_b.batches.cancel(cancel_batch.id)
    assert cancelling.status in ("cancelling", "cancelled"), cancelling
    cancelled = wait_batch(stack, on_b, cancel_batch.id, lambda b: b.status in ENDED and b.output_file_id,
                           "cancelled and exported")
    assert cancelled.status == "cancelled" and cancelled.cancelled_at is not None, cancelled
    out, err = answered_once(stack, on_b, cancelled, m, tag="l")
    assert err and all(line["error"] for line in err)  # the requests the cancel stopped

    finished = wait_batch(stack, on_b, done_batch.id, lambda b: b.status in ENDED, "ended")
    assert finished.status == "completed" and finished.completed_at is not None, finished
    out, err = answered_once(stack, on_b, finished, n)
    assert err == [] and finished.error_file_id is None
    assert all(line["response"]["status_code"] == 200 for line in out)
    assert "api" not in stack.procs  # completed with A stopped throughout


# -- 3. restarted mid-batch --------------------------------------------------------------------------------


def test_the_api_restarted_mid_batch_loses_nothing(stack):
    secret, _ = new_key(stack, "restarts")
    client = stack.openai(secret)
    n = 300
    f = client.files.create(file=("in.jsonl", batch_file(n)), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
    stack.kill("api")  # SIGKILL just after the create: the batch is still validating
    stack.start_api("api")  # same port: the same client goes on
    running = wait_batch(stack, client, batch.id,
                         lambda b: b.status == "in_progress" and b.request_counts.completed > 0,
                         "rows published")
    assert running.request_counts.completed < n, "the batch ended before the restart: nothing was tested"
    stack.restart_api("api")  # SIGTERM mid-run, then started again
    assert client.batches.retrieve(batch.id).status in ("in_progress", "finalizing", "completed")

    done = wait_batch(stack, client, batch.id, lambda b: b.status in ENDED, "ended")
    assert done.status == "completed", done
    out, err = answered_once(stack, client, done, n)
    assert err == [] and all(line["response"]["status_code"] == 200 for line in out)
    assert stack.exited["api"] == 0  # the SIGTERM was a graceful stop
