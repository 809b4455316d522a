"""Requests held for a model no worker serves are visible (job ``held``, ``{p}:held_models``), their
hold time is settable globally and per request, and ``Client.request`` says why it timed out."""

from __future__ import annotations

import json
import threading

import pytest

from batchinfer import ModelNotServed
from batchinfer.client.client import Client
from batchinfer.config import Settings
from batchinfer.keys import Keys
from batchinfer.protocol.entries import IntakeEntry
from batchinfer.protocol.rows import ResultRow, now_ms
from batchinfer.scheduler.daemon import SchedulerDaemon
from batchinfer.scheduler.staging import held_key
from batchinfer.store.jobstore import JobStore
from batchinfer.store.registry import Registry
from batchinfer.workers.text.tokenizer_files import read_tokenizer_files

KEYS = Keys("{h}")
CAP = {"max_model_len": 128, "max_num_seqs": 4, "max_num_batched_tokens": 256, "kv_tokens": 4096}


def run(sched: SchedulerDaemon) -> None:
    while sched.run_once():
        pass


def held_models(r) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in r.hgetall(KEYS.held_models).items()}


def test_held_requests_are_counted_and_uncounted_in_the_same_step(redis_server, tiny_llama):
    r = redis_server.client()
    sched = SchedulerDaemon(r, Settings(prefix=KEYS.prefix))
    sched.admission.models.refresh = 0
    client = Client(settings=Settings(redis_url=redis_server.url, prefix=KEYS.prefix))
    job = client.submit([{"prompt": "a", "max_tokens": 2}] * 3, model="later")
    body = json.dumps({"prompt": "x", "model": "later", "max_tokens": 2})
    r.xadd(KEYS.requests, IntakeEntry(body=body).to_fields())
    r.xadd(KEYS.requests, IntakeEntry(body=body.replace("later", "other")).to_fields())
    run(sched)
    assert r.xlen(held_key(KEYS)) == 5
    assert held_models(r) == {"later": 4, "other": 1}
    record = client.status(job)
    assert (record.held, record.request_counts["held"]) == (3, 3)

    registry = Registry(r, KEYS)
    registry.register_model("later", read_tokenizer_files(tiny_llama), CAP)
    sched.timers["held"].last = float("-inf")
    run(sched)
    assert r.xlen(held_key(KEYS)) == 1  # the "other" one still waits
    assert held_models(r) == {"later": 0, "other": 1}
    assert client.status(job).held == 0

    JobStore(r, KEYS).cancel(job)  # nothing negative when cancel and release race: both went already
    run(sched)
    assert client.status(job).held == 0 and min(held_models(r).values()) == 0
    client.close()


def test_direct_hold_time_is_settable_globally_and_per_request(redis_server):
    r = redis_server.client()
    assert Settings.from_env({"BATCHINFER_DIRECT_HOLD_SECONDS": "5"}).direct_hold_seconds == 5.0
    assert Settings().direct_hold_seconds == 600.0
    sched = SchedulerDaemon(r, Settings(prefix=KEYS.prefix, direct_hold_seconds=5))
    body = json.dumps({"prompt": "x", "model": "nobody", "max_tokens": 2})
    r.xadd(KEYS.requests, IntakeEntry(body=body).to_fields())  # the global 5 s
    r.xadd(KEYS.requests, IntakeEntry(body=body, hold_seconds=120).to_fields())  # its own 120 s
    r.xadd(KEYS.requests, IntakeEntry(body=body, reply_to="{h}:reply:now", hold_seconds=0).to_fields())
    began = now_ms()
    run(sched)
    waits = sorted(int(f[b"held_until"]) - began for _, f in r.xrange(held_key(KEYS)))
    assert len(waits) == 2 and 4000 < waits[0] <= 5500 and 119_000 < waits[1] <= 120_500
    [(_, reply)] = r.xrange("{h}:reply:now")  # 0: answered at once
    row = ResultRow.from_json(reply[b"row"])
    assert row.error_code == "unknown_model" and "'nobody' is not served" in row.error_message
    # the constructor's argument still wins over the setting
    assert SchedulerDaemon(r, Settings(prefix=KEYS.prefix), direct_hold_s=7).admission.direct_hold_s == 7


@pytest.mark.parametrize("bad", ["-1", "soon", "nan", "inf"])
def test_a_bad_hold_seconds_is_a_protocol_error(redis_server, bad):
    r = redis_server.client()
    body = json.dumps({"prompt": "x", "model": "nobody"})
    r.xadd(KEYS.requests, {"v": "1", "body": body, "reply_to": "{h}:reply:bad", "hold_seconds": bad})
    run(SchedulerDaemon(r, Settings(prefix=KEYS.prefix)))
    [(_, reply)] = r.xrange("{h}:reply:bad")
    row = ResultRow.from_json(reply[b"row"])
    assert row.error_code == "protocol_error"
    assert "hold_seconds must be a non-negative number" in row.error_message


def test_client_request_names_the_unserved_model_and_what_is_served(redis_server, tiny_llama):
    r = redis_server.client()
    registry = Registry(r, KEYS)
    for name in ("hf", "qwen"):
        registry.register_model(name, read_tokenizer_files(tiny_llama), CAP)
        registry.heartbeat_worker(f"w-{name}", {"model": name, "capacity": CAP}, ttl=60)
    client = Client(settings=Settings(redis_url=redis_server.url, prefix=KEYS.prefix))
    with pytest.raises(ModelNotServed) as info:
        client.request({"prompt": "x"}, model="SmolLM2", timeout=0.3)
    assert str(info.value) == "1 request held: model 'SmolLM2' is not served; served: hf, qwen"
    assert isinstance(info.value, TimeoutError) and info.value.held == {"SmolLM2": 1}
    with pytest.raises(ModelNotServed, match="^2 requests held: model 'SmolLM2' is not served"):
        list(client.requests([{"prompt": "x"}, {"prompt": "y"}], model="SmolLM2", timeout=0.3))
    # hold_seconds=0 with a scheduler: the unknown_model row comes back at once, no timeout
    r.delete(KEYS.requests)
    stop = threading.Event()
    thread = threading.Thread(target=SchedulerDaemon(redis_server.client(), Settings(prefix=KEYS.prefix)).run,
                              args=(stop,), daemon=True)
    thread.start()
    try:
        row = client.request({"prompt": "x"}, model="SmolLM2", timeout=5, hold_seconds=0)
    finally:
        stop.set()
        thread.join(timeout=5)
    assert row.error_code == "unknown_model"
    client.close()
