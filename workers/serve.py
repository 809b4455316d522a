"""``batchinfer worker``: build the engine, serve until SIGTERM.

The process around :class:`~batchinfer.workers.daemon.WorkerDaemon`: the engine (or the echo
engine) from the command line's options, the Redis connection, the signal handlers that turn
SIGTERM / SIGINT into the loop's drain and hard-stop events, and the ``/metrics`` server.
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import threading
from collections.abc import Iterable
from typing import Any

from batchinfer.config import Settings
from batchinfer.ops.httpserver import Readiness
from batchinfer.ops.httpserver import serve as serve_http
from batchinfer.ops.metrics import WorkerMetrics
from batchinfer.store.registry import read_tokenizer_files
from batchinfer.workers.daemon import WorkerDaemon
from batchinfer.workers.engine.interface import WorkerEngine

log = logging.getLogger(__name__)


def parse_engine_options(pairs: Iterable[str]) -> dict[str, Any]:
    """``--engine-option KEY=VALUE`` pairs as keyword arguments: VALUE is JSON when it parses, else text.

    ValueError names a pair without ``=`` or a key that is not an identifier.
    """
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise ValueError(f"{pair!r}: use KEY=VALUE with KEY a setting name, e.g. max_num_seqs=8")
        try:
            options[key] = json.loads(raw)
        except ValueError:
            options[key] = raw
    return options


def main(settings: Settings, model_dir: str | None, name: str | None = None, device: str = "cpu",
         echo: bool = False, *, model_name: str | None = None,
         engine_options: dict[str, Any] | None = None) -> int:
    """``batchinfer worker``: build the engine (or the echo engine), then serve until SIGTERM."""
    from batchinfer.redis_conn import connect

    options = dict(engine_options or {})
    if not echo and not model_dir:
        raise ValueError("--model: a model folder is required (or --echo)")
    engine: WorkerEngine
    try:
        if echo:
            from batchinfer.workers.echo_engine import EchoEngine

            engine = EchoEngine.from_model_dir(model_dir, **options) if model_dir else EchoEngine(**options)
        else:
            from batchinfer.workers.config import EngineConfig
            from batchinfer.workers.engine.engine import Engine

            engine = Engine(EngineConfig(model=str(model_dir), device=device, **options))
    except TypeError as e:  # an engine option the engine does not have
        raise ValueError(f"engine options {sorted(options)}: {e}") from None
    files = read_tokenizer_files(model_dir) if model_dir else engine.tokenizer_files()
    model = model_name or engine.model_name
    name = name or f"{socket.gethostname()}-{model}-{device.replace(':', '')}"
    stop, hard = threading.Event(), threading.Event()

    def on_signal(signum, frame):
        if stop.is_set():
            hard.set()
        stop.set()
        log.info("worker %s: %s received; %s", name, signal.Signals(signum).name,
                 "stopping now" if hard.is_set() else "draining (again to stop at once)")

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    r = connect(settings.redis_url, settings.redis_ca_file)
    metrics = WorkerMetrics(model, worker=name, device=device)
    readiness = Readiness(stall_after=10 * settings.lease_seconds)
    readiness.mark("serving", False, "registering")
    readiness.add_probe("redis", r.ping)
    daemon = WorkerDaemon(r, settings, engine, name, model, device=device, tokenizer_files=files,
                          hard_stop=hard, metrics=metrics, readiness=readiness)
    server = serve_http(settings.metrics_port, metrics.registry, readiness)
    try:
        return daemon.run(stop)
    finally:
        if server is not None:
            server.stop()
