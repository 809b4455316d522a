"""Worker names: unique by default, never shared by two live workers, retaken after a crash.

A real redis-server and worker daemons with the echo engine, in threads (``hard_stop`` ends them).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

from daemons import ThreadedWorker, wait_until, worker_daemon

from batchinfer.config import Settings
from batchinfer.keys import WORKERS_GROUP, Keys
from batchinfer.protocol.rows import BatchRequest
from batchinfer.store.jobstore import JobStore
from batchinfer.store.registry import Registry, WorkerNameTaken
from batchinfer.workers.service.echo_engine import EchoEngine
from batchinfer.workers.service.worker_config import WorkerConfig

PREFIX = "{n}"
KEYS = Keys(PREFIX)
BEAT = 0.2




def Serving(r, name=None, **kw) -> ThreadedWorker:  # noqa: N802 - reads as a class
    """An echo worker in a thread; ``.hard`` is its hard-stop event."""
    hard = threading.Event()
    settings = Settings(prefix=PREFIX, heartbeat_seconds=BEAT)
    worker = ThreadedWorker(worker_daemon(r, settings, EchoEngine(), name, hard_stop=hard, **kw))
    worker.hard = hard
    return worker


def _name_in_a_new_process() -> str:
    code = ("from batchinfer.workers.service.worker_config import WorkerConfig; "
            "print(WorkerConfig(model='SmolLM2', device='cuda:0').name)")
    return subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip()


def test_default_names_are_unique_per_process():
    host = socket.gethostname()
    assert WorkerConfig(model="SmolLM2", device="cuda:0").name == f"{host}-SmolLM2-cuda0-{os.getpid()}"
    assert WorkerConfig(model="m", served_model_names=["smol", "alias"]).name.startswith(f"{host}-smol-cpu-")
    assert WorkerConfig(model="m", name="given").name == "given"
    first, second = _name_in_a_new_process(), _name_in_a_new_process()
    assert first != second and first.startswith(f"{host}-SmolLM2-cuda0-")


def test_a_live_workers_name_is_refused(redis_server):
    r = redis_server.client()
    live = Serving(r)  # the default name, as two `worker --model X --device cpu` on one host had
    wait_until(lambda: Registry(r, KEYS).live_workers(), what="first worker live")
    began = time.monotonic()
    second = Serving(r)
    second.thread.join(timeout=10)
    assert isinstance(second.error, WorkerNameTaken), second.error
    assert time.monotonic() - began < 5 * BEAT + 2  # told within a heartbeat or two, not a TTL
    message = str(second.error)
    assert f"worker name {live.daemon.name!r} is taken by a live worker (pid {os.getpid()}" in message
    assert message.endswith("give this worker another --name")
    # the refused worker neither took nor removed the live one's registration
    (worker,) = Registry(r, KEYS).live_workers()
    assert worker.name == live.daemon.name and worker.info["instance"] == live.daemon.instance
    assert live.stop() == 0
    assert Registry(r, KEYS).live_workers() == []


def test_a_restart_after_a_crash_takes_its_old_name_and_batches(redis_server):
    r = redis_server.client()
    registry = Registry(r, KEYS)
    # the previous run of "w1" died: its registration (another instance) outlives it by its TTL ...
    assert registry.claim_worker("w1", "dead-instance", {"model": "echo", "pid": 1}, ttl=3 * BEAT) is None
    # ... and it held a batch (of a job that exists: a row of a job with no record is dropped)
    JobStore(r, KEYS).create("j", model="echo")
    request = BatchRequest(request_id="j:0", job_id="j", idx=0, prompt_token_ids=[1, 2, 3],
                           sampling_params={"max_tokens": 2}, model="echo")
    r.xgroup_create(KEYS.batches("echo"), WORKERS_GROUP, id="0", mkstream=True)
    r.xadd(KEYS.batches("echo"), {"v": "1", "requests": json.dumps([request.to_dict()])})
    r.xreadgroup(WORKERS_GROUP, "w1", {KEYS.batches("echo"): ">"}, count=1)
    began = time.monotonic()
    worker = Serving(r, "w1")
    wait_until(lambda: r.xlen(KEYS.results("j")) == 1, timeout=10, what="the held batch answered")
    assert time.monotonic() - began >= 0.5 * BEAT  # it waited for the old registration to lapse
    assert worker.error is None
    (live,) = registry.live_workers()
    assert live.name == "w1" and live.info["instance"] == worker.daemon.instance
    assert worker.stop() == 0


def test_a_hard_stop_while_waiting_for_the_name_ends_the_worker(redis_server):
    r = redis_server.client()
    registry = Registry(r, KEYS)
    assert registry.claim_worker("w1", "other", {"model": "echo"}, ttl=60) is None  # never refreshed
    worker = Serving(r, "w1")
    time.sleep(3 * BEAT)
    worker.hard.set()
    worker.thread.join(timeout=5)
    assert not worker.thread.is_alive() and worker.code == 1 and worker.error is None
    assert registry.live_workers()[0].info["instance"] == "other"  # not its to remove
