"""The small helpers every role shares, each defined once: ``now_ms`` (protocol.rows), ``as_text`` and
``Backoff`` (redis_conn), and the daemon loops that wait out a Redis outage with a ``Backoff``."""

from __future__ import annotations

import ast
import socket
import threading
import time
from pathlib import Path

import pytest
import tomllib

from batchinfer.config import Settings
from batchinfer.protocol import rows
from batchinfer.redis_conn import Backoff, as_text, connect
from batchinfer.store import queue_state

ROOT = Path(__file__).resolve().parents[1]


def _sources() -> list[Path]:
    """Every module of the distribution (the folders of pyproject's package-dir)."""
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    folders = {ROOT / folder for folder in package_dir.values()}
    return sorted({p for folder in folders for p in folder.rglob("*.py")})


# -- now_ms ---------------------------------------------------------------------------------------

def test_now_ms_floors_integer_nanoseconds(monkeypatch):
    # 1 ns before a millisecond ends: as a float of seconds this instant rounds up to the next
    # second, so int(time.time() * 1000) would name a millisecond that has not begun
    instant = 1_700_000_000_999_999_999
    assert int(instant / 1e9 * 1000) == 1_700_000_001_000
    monkeypatch.setattr(time, "time_ns", lambda: instant)
    assert rows.now_ms() == 1_700_000_000_999


def test_now_ms_is_defined_once_and_no_module_computes_its_own():
    defs, float_ms = [], []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.strip("_") == "now_ms":
                defs.append(f"{path.relative_to(ROOT)}:{node.lineno}")
            # time.time() * 1000 (either order): the float clock the one now_ms replaces
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult) and any(
                    isinstance(side, ast.Call) and ast.unparse(side.func) == "time.time"
                    for side in (node.left, node.right)):
                float_ms.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert len(defs) == 1 and defs[0].startswith("batchinfer/protocol/rows.py:"), defs
    assert float_ms == []


def test_modules_stamping_times_use_the_protocol_clock(redis_server, monkeypatch):
    # with the protocol clock frozen, every time a module stamps or measures from is that instant
    from batchinfer.keys import Keys
    from batchinfer.store.publish import Publisher
    from batchinfer.store.registry import Registry
    from batchinfer.workers.service.echo_engine import byte_tokenizer_files

    r, keys = redis_server.client(), Keys("{clk}")
    cap = {"max_model_len": 64, "max_num_seqs": 2, "max_num_batched_tokens": 64, "kv_tokens": 256}
    monkeypatch.setattr(time, "time_ns", lambda: 1_700_000_000_123_999_999)
    instant = b"1700000000123"
    registry = Registry(r, keys)
    registry.register_model("m", byte_tokenizer_files(), cap)
    registry.heartbeat_worker("w", {"model": "m"}, ttl=60)
    r.hset(keys.job("j"), mapping={"id": "j", "status": "validating", "completed": 0, "failed": 0})
    Publisher(r, keys).finish_submission("j", 1)
    assert r.hget(keys.model("m"), "registered_at") == instant
    assert r.hget(keys.worker("w"), "heartbeat_at") == instant
    assert r.hget(keys.job("j"), "in_progress_at") == instant
    assert queue_state.StreamState(oldest_undelivered_ms=int(instant) - 2500).lag_seconds() == 2.5


# -- as_text --------------------------------------------------------------------------------------

def test_as_text_decodes_bytes_and_keeps_text_and_none():
    assert as_text(b"in_progress") == "in_progress"
    assert as_text("in_progress") == "in_progress"
    assert as_text("é".encode()) == "é"
    assert as_text(None) is None  # an absent field (HGET / HMGET) stays absent
    assert as_text(7) == "7"  # integer replies (XINFO's lag, pending)


def test_as_text_is_strict_unless_told_otherwise():
    with pytest.raises(UnicodeDecodeError):
        as_text(b"\xffjob")
    assert as_text(b"\xffjob", "replace") == "\ufffdjob"


def test_queue_views_survive_a_stray_byte():
    # top and the metrics collectors read whatever is in Redis: a bad byte is shown, not raised
    view = queue_state.job_view("j", {b"status": b"in_progress", b"model": b"m\xff", b"completed": 3,
                                      b"created_at": b"1000"})
    assert (view.model, view.completed, view.created_at) == ("m\ufffd", 3, 1000)


# -- Backoff --------------------------------------------------------------------------------------

def _waits(backoff: Backoff, n: int) -> list[float]:
    return [backoff.next() for _ in range(n)]


def test_backoff_doubles_up_to_its_cap():
    assert _waits(Backoff(0.1, 5.0), 8) == [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0]
    assert _waits(Backoff(1, 30, factor=3), 5) == [1, 3, 9, 27, 30]
    assert _waits(Backoff(2, 2), 3) == [2, 2, 2]


def test_backoff_reset_starts_over():
    backoff = Backoff(0.5, 10.0)
    _waits(backoff, 4)
    backoff.reset()
    assert _waits(backoff, 3) == [0.5, 1.0, 2.0]


@pytest.mark.parametrize("start, cap, factor", [(0, 1, 2), (-1, 1, 2), (2, 1, 2), (1, 2, 0.5)])
def test_backoff_refuses_a_shrinking_or_empty_schedule(start, cap, factor):
    with pytest.raises(ValueError):
        Backoff(start, cap, factor)


# -- the loops, against a Redis that is not there --------------------------------------------------

class StopAfter(threading.Event):
    """A stop event that records each wait instead of waiting, and sets itself after ``n`` waits."""

    def __init__(self, n: int):
        super().__init__()
        self.n, self.waits = n, []

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(timeout)
        if len(self.waits) >= self.n:
            self.set()
        return self.is_set()


@pytest.fixture
def nowhere(monkeypatch) -> str:
    """A Redis URL where nothing listens; redis-py's own retries off, so each try fails at once."""
    monkeypatch.setattr("batchinfer.redis_conn.RETRIES", 0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"redis://127.0.0.1:{port}/0"


def test_scheduler_loop_backs_off_while_redis_is_away(nowhere):
    from batchinfer.scheduler.daemon import SchedulerDaemon

    stop = StopAfter(8)
    SchedulerDaemon(connect(nowhere), Settings(prefix="{h}")).run(stop)
    assert stop.waits == [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0]


def test_worker_loop_backs_off_while_redis_is_away(nowhere):
    from daemons import worker_daemon

    from batchinfer.workers.service.echo_engine import EchoEngine

    hard_stop = StopAfter(7)
    daemon = worker_daemon(connect(nowhere), Settings(prefix="{h}"), EchoEngine(), "w1", hard_stop=hard_stop)
    assert daemon.run(threading.Event()) == 1  # hard-stopped, not a clean drain
    assert hard_stop.waits == [0.5, 1, 2, 4, 8, 10, 10]


def test_exporter_rebuilds_with_backoff_while_redis_is_away(nowhere, monkeypatch):
    from batchinfer.jobs import exporter

    waits: list[float] = []

    def sleep(seconds: float, stopping: threading.Event) -> None:
        waits.append(seconds)
        if len(waits) == 7:
            stopping.set()

    monkeypatch.setattr(exporter, "_sleep_unless_stopped", sleep)
    assert exporter._run(Settings(redis_url=nowhere, prefix="{h}"), "exporter-test", burst=False) == 0
    assert waits == [1, 2, 4, 8, 16, 30, 30]
