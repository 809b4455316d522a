"""Daemons as real subprocesses for end-to-end and fault tests, and a TCP proxy that can cut a link.

:class:`Stack` starts ``python -m batchinfer.cli scheduler|worker|exporter`` against one Redis and
one key prefix, each in its own process group (so a kill reaches everything a daemon started),
with its log in a file; every wait is bounded and fails with the daemons' log tails. Tests import
it after their conftest puts ``tests/`` on ``sys.path`` (pytest runs with ``--import-mode=importlib``).

:class:`TcpProxy` sits between one daemon and Redis on 127.0.0.1; :meth:`TcpProxy.cut` makes the
link a black hole (nothing is forwarded either way, connections stay open, as in a network
partition) until :meth:`TcpProxy.restore`, when what was sent meanwhile arrives late, as TCP
retransmission would deliver it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from faulty_echo import ENGINE_CLASS, FAULT_OPTIONS

from batchinfer.cli.runner import python_module
from batchinfer.client.client import Client
from batchinfer.config import Settings
from batchinfer.scheduler.daemon import SchedulerDaemon
from batchinfer.store.registry import Registry
from batchinfer.workers.service.daemon import WorkerDaemon
from batchinfer.workers.service.worker_config import WorkerConfig

CLI = python_module("batchinfer.cli")
TESTS = str(Path(__file__).resolve().parent)  # on a daemon's PYTHONPATH for tests/faulty_echo.py
START_TIMEOUT_S = 180
JOB_TIMEOUT_S = 300
LOG_TAIL_LINES = 40
# Fault tests: short leases and fast heartbeats, so a dead worker's batch comes back within seconds.
# A killed scheduler's successor (or a standby) takes the ownership over within 2 s.
FAULT_ENV = {"BATCHINFER_LEASE_SECONDS": "2", "BATCHINFER_HEARTBEAT_SECONDS": "0.5",
             "BATCHINFER_SCHEDULER_TAKEOVER_SECONDS": "2"}
# Echo workers slow enough that a kill lands while a batch is half done (8 requests: 4 steps).
SLOW_ECHO = {"step_delay": 0.05, "requests_per_step": 2, "max_num_seqs": 8}


class Stack:
    """Daemons started for a test, their logs, and a Client on the same queue.

    ``env`` entries override the defaults (``BATCHINFER_*`` settings shared by every daemon).
    """

    def __init__(self, redis_url: str, tmp: Path, env: dict[str, str] | None = None):
        self.tmp = tmp
        self.redis_url = redis_url
        self.prefix = (env or {}).get("BATCHINFER_PREFIX") or f"{{e{uuid.uuid4().hex[:8]}}}"
        self.env = {**os.environ, "BATCHINFER_REDIS_URL": redis_url, "BATCHINFER_PREFIX": self.prefix,
                    "BATCHINFER_RESULTS_ROOT": str(tmp / "results"), "BATCHINFER_HEARTBEAT_SECONDS": "1",
                    "BATCHINFER_LEASE_SECONDS": "20", "OMP_NUM_THREADS": "1",
                    "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1", **(env or {})}
        self.procs: dict[str, subprocess.Popen] = {}
        self.exited: dict[str, int] = {}  # daemons stopped by the test, with their exit codes
        self.client = Client(settings=Settings(redis_url=redis_url, prefix=self.prefix,
                                               partitions=int(self.env.get("BATCHINFER_PARTITIONS") or 1)))

    # -- processes --------------------------------------------------------------------------------

    def start(self, name: str, *args: str, env: dict[str, str] | None = None,
              preexec_fn: Callable[[], None] | None = None) -> subprocess.Popen:
        """Start ``batchinfer <args>`` as daemon ``name`` (its own process group; log in ``<name>.log``)."""
        assert name not in self.procs, f"{name} is already running"
        with open(self.tmp / f"{name}.log", "ab") as log:
            proc = subprocess.Popen([*CLI, *args], env={**self.env, **(env or {})}, stdout=log, cwd=self.tmp,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, preexec_fn=preexec_fn)
        self.procs[name] = proc
        return proc

    def worker(self, name: str, model_dir: Path | None = None, *, echo: bool = False,
               options: dict[str, Any] | None = None, redis_url: str | None = None,
               env: dict[str, str] | None = None) -> subprocess.Popen:
        """A worker named ``name``: the model in ``model_dir``, or the echo engine (``echo``), with
        ``--engine-option`` settings; ``redis_url`` reaches Redis another way (e.g. a proxy)."""
        args = ["worker", "--name", name, "--device", "cpu"]
        if model_dir is not None:
            args += ["--model", str(model_dir)]
        if echo:
            args.append("--echo")
        extra = {**(env or {}), **({"BATCHINFER_REDIS_URL": redis_url} if redis_url else {})}
        if echo and set(FAULT_OPTIONS) & set(options or {}):  # the test double that injects them
            args += ["--echo-class", ENGINE_CLASS]
            extra["PYTHONPATH"] = os.pathsep.join(filter(None, [TESTS, extra.get("PYTHONPATH")]))
        for key, value in (options or {}).items():
            args += ["--engine-option", f"{key}={value}"]
        return self.start(name, *args, env=extra)

    def send(self, name: str, sig: int) -> None:
        """Send ``sig`` to daemon ``name`` only (not its group)."""
        self.procs[name].send_signal(sig)

    def stop(self, name: str, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        """Signal daemon ``name`` and wait for it; SIGKILL its group if it does not exit in time."""
        proc = self.procs.pop(name)
        if proc.poll() is None:
            if sig == signal.SIGKILL:
                _killpg(proc)
            else:
                proc.send_signal(sig)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _killpg(proc)
                proc.wait(timeout=10)
        _killpg(proc)  # whatever it started must not outlive it
        self.exited[name] = proc.returncode
        return proc.returncode

    def wait_exit(self, name: str, timeout: float = 60) -> int:
        """Wait for daemon ``name`` to exit on its own (e.g. draining after a signal): its exit code.

        No second signal is sent: a second SIGTERM means "stop at once" to a worker.
        """
        proc = self.procs[name]
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{name} did not exit within {timeout} s\n{self.logs()}") from None
        self.procs.pop(name)
        _killpg(proc)
        self.exited[name] = code
        return code

    def kill(self, name: str) -> int:
        """SIGKILL daemon ``name`` (and its process group), as a crash would."""
        return self.stop(name, signal.SIGKILL)

    def close(self) -> None:
        """Stop every daemon (SIGTERM, then SIGKILL after a grace period)."""
        for name in list(self.procs):
            self.stop(name, timeout=20)
        self.client.close()

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            assert proc.poll() is None, f"{name} exited with {proc.returncode}\n{self.logs()}"

    # -- waiting ----------------------------------------------------------------------------------

    def until(self, cond: Callable[[], Any], timeout: float, what: str, poll: float = 0.05) -> Any:
        """Poll ``cond`` until it returns a truthy value (returned); fails with the logs on timeout
        or when a daemon died meanwhile."""
        return wait_for(cond, what, timeout, alive=self.check_alive, poll=poll, details=self.logs)

    def wait_for_workers(self, count: int, timeout: float = START_TIMEOUT_S) -> None:
        """Until ``count`` workers are live (a daemon that died fails the test at once)."""
        registry = Registry(self.client.redis, self.client.keys)
        self.until(lambda: len(registry.live_workers()) >= count, timeout, f"{count} live worker(s)")

    def wait_for_worker(self, name: str, timeout: float = START_TIMEOUT_S) -> None:
        registry = Registry(self.client.redis, self.client.keys)
        self.until(lambda: name in {w.name for w in registry.live_workers()}, timeout, f"worker {name}")

    def wait(self, job: str, timeout: float = JOB_TIMEOUT_S):
        """The job's record once it is terminal."""
        return self.until(lambda: (rec := self.client.status(job)).terminal and rec, timeout,
                          f"job {job} to end", poll=0.2)

    def cli(self, *args: str, timeout: float = JOB_TIMEOUT_S) -> subprocess.CompletedProcess:
        return subprocess.run([*CLI, *args], env=self.env, capture_output=True, text=True, timeout=timeout,
                              cwd=self.tmp)

    def logs(self) -> str:
        parts = []
        for path in sorted(self.tmp.glob("*.log")):
            lines = path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
            parts.append(f"----- {path.name} -----\n" + "\n".join(lines))
        return "\n".join(parts)


def serve_tiny(r: Any, keys: Any, tokenizer_files: dict[str, bytes], capacity: dict[str, int],
               ttl: float = 600) -> Registry:
    """Register model ``tiny`` (its tokenizer files, ``capacity``) and a live worker ``w1`` serving it,
    as a scheduler sees them: what the scheduler tests need instead of a running worker."""
    registry = Registry(r, keys)
    registry.register_model("tiny", tokenizer_files, capacity)
    registry.heartbeat_worker("w1", {"model": "tiny", "capacity": capacity}, ttl=ttl)
    return registry


def wait_for(cond: Callable[[], Any], what: str, timeout: float = 60.0,
             alive: Callable[[], Any] | None = None, *, poll: float = 0.05,
             details: Callable[[], str] | None = None) -> Any:
    """Poll ``cond`` until it returns a truthy value (returned). ``alive()`` runs between polls (it
    fails the test when something it watches died); on timeout the assertion carries ``details()``."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if alive is not None:
            alive()
        assert time.monotonic() < deadline, f"waited {timeout} s for {what}" + (
            f"\n{details()}" if details else "")
        time.sleep(poll)


def wait_until(cond: Callable[[], Any], timeout: float = 60.0, what: str = "condition",
               tick: Callable[[], Any] | None = None) -> Any:
    """Poll ``cond`` every 20 ms until it returns a truthy value (returned); ``tick()`` (e.g. one
    scheduler pass) runs before each poll. For daemons in threads of the test's own process."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if tick is not None:
            tick()
        value = cond()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


CONFIG_FIELDS = {f.name for f in dataclasses.fields(WorkerConfig)}


def worker_daemon(r: Any, settings: Settings, engine: Any, name: str | None = None,
                  **kw: Any) -> WorkerDaemon:
    """A ``WorkerDaemon`` of ``engine`` named ``name``: the keywords that are ``WorkerConfig``'s fields
    (``served_model_names``, ``block_ms``, ``cancel_poll_seconds``, ...) go to its config, the others
    (``hard_stop``, ``clock``, ...) to the daemon."""
    fields = {k: v for k, v in kw.items() if k in CONFIG_FIELDS}
    config = WorkerConfig(model=engine.model_name, name=name, **fields)
    return WorkerDaemon(r, settings, engine, config, **{k: v for k, v in kw.items() if k not in fields})


def dispatched(r: Any, keys: Any, model: str) -> Counter:
    """(job, idx) -> how many places hold it, in every partition of ``keys``: batch entries of
    ``model`` (tests where no worker reads them) and its staging streams (dispatch stops at its
    backpressure while nobody reads)."""
    from batchinfer.scheduler.staging import Staging, queue_key

    seen: Counter = Counter()
    for view in keys.parts():
        for _, fields in r.xrange(view.batches(model)):
            for q in json.loads(fields[b"requests"]):
                seen[(q["job_id"], q["idx"])] += 1
        for member, _ in Staging(r, view).members(model):
            for _, fields in r.xrange(queue_key(view, model, member)):
                q = json.loads(fields[b"req"])
                seen[(q["job_id"], q["idx"])] += 1
    return seen


def interleave(steps: list[str], schedulers: dict[str, Any], submit: Callable[[], None],
               lapse_s: float) -> None:
    """The schedulers' passes in the order ``steps`` gives: a scheduler's name runs one of its passes,
    ``lapse`` sleeps past the takeover time ``lapse_s`` (nobody runs meanwhile), ``submit`` calls
    ``submit()``; one more ``submit`` at the end, then every scheduler runs until it finds no work."""
    for step in [*steps, "submit"]:
        if step == "submit":
            submit()
        elif step == "lapse":
            time.sleep(lapse_s * 1.2)
        else:
            schedulers[step].run_once()
    for _ in range(3):
        for sched in schedulers.values():
            for _ in range(20):
                if not sched.run_once():
                    break


class Schedulers:
    """Schedulers (``SchedulerDaemon``) serving in threads of the test, named by the test."""

    def __init__(self, r, settings: Settings):
        self.r, self.settings = r, settings
        self.running: dict[str, tuple[SchedulerDaemon, threading.Event, threading.Thread]] = {}

    def start(self, name: str) -> SchedulerDaemon:
        sched = SchedulerDaemon(self.r, self.settings, instance=name, block_ms=50)
        sched.admission.models.refresh = 0
        stop = threading.Event()
        thread = threading.Thread(target=sched.run, args=(stop,), daemon=True)
        thread.start()
        self.running[name] = (sched, stop, thread)
        return sched

    def stop(self, name: str) -> None:
        _, stop, thread = self.running.pop(name)
        stop.set()
        thread.join(timeout=20)
        assert not thread.is_alive()

    def close(self) -> None:
        for name in list(self.running):
            self.stop(name)


def job_in(keys: Any, partition: int, stem: str) -> str:
    """The first job id ``<stem><n>`` that lives in ``partition`` of ``keys``."""
    return next(f"{stem}{i}" for i in range(1000) if keys.job_partition(f"{stem}{i}") == partition)


class ThreadedWorker:
    """A ``WorkerDaemon`` serving in a thread; ``stop()`` drains it and returns its exit code. An
    exception ``run`` raised is kept in ``error`` (tests of refused starts look at it)."""

    def __init__(self, daemon: Any):
        self.daemon = daemon
        self.stop_event = threading.Event()
        self.error: BaseException | None = None
        self.code: int | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.code = self.daemon.run(self.stop_event)
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            self.error = e

    def stop(self) -> int | None:
        self.stop_event.set()
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "daemon did not drain"
        return self.code


def start_echo_job(stack: Stack, n: int, scheduler: str = "scheduler", job_id: str | None = None) -> str:
    """The fault tests' job: a scheduler named ``scheduler``, the exporter and two slow echo workers
    (``a``, ``b``) are started and live, then ``n`` requests ``r0`` .. ``r<n-1>`` are submitted to
    model ``echo``; returns the job id."""
    stack.start(scheduler, "scheduler")
    stack.start("exporter", "exporter")
    for name in ("a", "b"):
        stack.worker(name, echo=True, options=SLOW_ECHO)
    stack.wait_for_workers(2)
    return submit_echo_job(stack, n, job_id)


def submit_echo_job(stack: Stack, n: int, job_id: str | None = None) -> str:
    """``n`` requests ``r0`` .. ``r<n-1>`` to model ``echo``, as job ``job_id`` (default: a new id)."""
    return stack.client.submit([{"custom_id": f"r{i}", "prompt": f"request {i:03d}", "max_tokens": 3}
                                for i in range(n)], model="echo", job_id=job_id)


def poison_stack(stacks: Callable[..., Stack], redis_url: str, max_attempts: int) -> Stack:
    """The poison tests' stack: a scheduler and an exporter on ``redis_url``, ``max_attempts`` tries
    per request (the workers, with the poison options, are each test's own)."""
    stack = stacks(redis_url, BATCHINFER_MAX_ATTEMPTS=str(max_attempts))
    stack.start("scheduler", "scheduler")
    stack.start("exporter", "exporter")
    return stack


def submit_poison_job(stack: Stack, n: int, poison_idx: int) -> tuple[str, list[str]]:
    """Submit ``n`` echo requests ``r0`` .. ``r<n-1>`` (4 tokens each) whose ``poison_idx``-th prompt
    holds ``POISON`` (the echo engine's ``poison`` marker); returns the job id and the prompts."""
    prompts = [f"request {i:03d}" if i != poison_idx else "a POISON pill" for i in range(n)]
    job = stack.client.submit([{"custom_id": f"r{i}", "prompt": p, "max_tokens": 4}
                               for i, p in enumerate(prompts)], model="echo")
    return job, prompts


def _killpg(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


class TcpProxy:
    """A threaded TCP proxy on 127.0.0.1 to ``target_port`` whose link the test can cut and restore."""

    def __init__(self, target_port: int, target_host: str = "127.0.0.1"):
        self.target = (target_host, target_port)
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._open = threading.Event()
        self._open.set()
        self._closed = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="proxy-accept", daemon=True).start()

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def cut(self) -> None:
        """Stop forwarding in both directions; connections stay open (a network partition)."""
        self._open.clear()

    def restore(self) -> None:
        """Forward again, including what was sent during the cut."""
        self._open.set()

    def close(self) -> None:
        self._closed = True
        self._open.set()
        with contextlib.suppress(OSError):
            self._server.close()
        with self._lock:
            for s in self._sockets:
                with contextlib.suppress(OSError):
                    s.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._connect, args=(client,), daemon=True).start()

    def _connect(self, client: socket.socket) -> None:
        self._open.wait()  # during a cut, a new connection hangs as in a partition
        try:
            upstream = socket.create_connection(self.target, timeout=5)
            upstream.settimeout(None)
        except OSError:
            client.close()
            return
        with self._lock:
            self._sockets += [client, upstream]
        for src, dst in ((client, upstream), (upstream, client)):
            threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                self._open.wait()  # held while cut: delivered late, never dropped
                if self._closed:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)


# -- checks on what a stack left in Redis ----------------------------------------------------------


def stream_rows(stack: Stack, job: str) -> list[dict]:
    """Every row on the job's results stream, duplicates included (XRANGE, not the client's reader)."""
    r = stack.client.redis
    return [json.loads(fields[b"row"]) for _, fields in r.xrange(stack.client.keys.results(job))]


def assert_exactly_once(stack: Stack, job: str, n: int, record) -> list[dict]:
    """One row per request on the results stream and in the exported Parquet file; returns the rows.

    The stream is checked first: the exporter drops duplicate idx values, so the file alone would
    hide a duplicate publication.
    """
    rows = stream_rows(stack, job)
    counts = Counter(r["idx"] for r in rows)
    duplicated = {idx: c for idx, c in counts.items() if c > 1}
    lost = sorted(set(range(n)) - set(counts))
    assert not duplicated and not lost, f"duplicated {duplicated}, lost {lost}\n{stack.logs()}"
    assert len(rows) == n
    assert record.done == n and record.total == n, record
    table = pq.read_table(record.output).to_pylist()
    assert [r["idx"] for r in table] == list(range(n))
    by_idx = {r["idx"]: r for r in rows}
    assert all(t["status"] == by_idx[t["idx"]]["status"] for t in table)
    return rows


def attempts(stack: Stack, job: str) -> dict[int, int]:
    """``{p}:attempts:<job>``: idx -> attempts counted for it."""
    raw = stack.client.redis.hgetall(stack.client.keys.attempts(job))
    return {int(k): int(v) for k, v in raw.items()}


def dead_letters(stack: Stack) -> list[dict]:
    entries = stack.client.redis.xrange(stack.client.keys.deadletter)
    return [{k.decode(): v.decode() for k, v in fields.items()} for _, fields in entries]


def pending_of(stack: Stack, model: str, consumer: str) -> list[str]:
    """Batch entries of ``model`` delivered to ``consumer`` and not acknowledged."""
    r = stack.client.redis
    stream = stack.client.keys.batches(model)
    if not r.exists(stream):
        return []
    entries = r.xpending_range(stream, "workers", "-", "+", 1000, consumername=consumer)
    return [e["message_id"].decode() for e in entries]


def requests_in(stack: Stack, model: str, entry_ids: list[str]) -> list[dict]:
    """The requests of batch entries (those still on the stream)."""
    r = stack.client.redis
    stream = stack.client.keys.batches(model)
    out = []
    for eid in entry_ids:
        for _, fields in r.xrange(stream, min=eid, max=eid):
            out += json.loads(fields[b"requests"])
    return out
