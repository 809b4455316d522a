"""The one small HTTP server of each daemon (``--metrics-port``): ``/metrics``, ``/healthz``, ``/readyz``.

It listens on ``127.0.0.1`` unless told otherwise (``--metrics-host`` / ``BATCHINFER_METRICS_HOST``):
it has no authentication, and ``/metrics`` names models, workers and queue sizes, so reaching it
from other machines is the operator's explicit choice (``0.0.0.0``, or one interface's address).

- ``/metrics``: the daemon's Prometheus registry (text format, or OpenMetrics when asked for);
- ``/healthz``: 200 while the process is alive and its loop is not stuck (liveness);
- ``/readyz``: 200 when every readiness condition holds (model loaded, Redis reachable), else 503;
  the body is JSON naming each condition, so ``curl`` shows what is missing.

It runs in daemon threads beside the daemon's loop and never touches the loop's state: readiness
comes from a :class:`Readiness` the loop marks, and from probes run per request.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import logging
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

log = logging.getLogger(__name__)
TEXT = "text/plain; charset=utf-8"
DEFAULT_HOST = "127.0.0.1"  # loopback only: the endpoints have no authentication


class Readiness:
    """Named conditions of readiness: marks set by the daemon, and probes run at each ``/readyz``.

    >>> ready = Readiness(stall_after=300)
    >>> ready.mark("model", False, "loading")          # later: ready.mark("model", True)
    >>> ready.add_probe("redis", redis_client.ping)    # raises or returns falsy -> not ready
    >>> ready.tick()                                   # each loop iteration: the loop is not stuck

    With ``stall_after`` set, ``/healthz`` fails once the loop has ticked and then not ticked again
    for that many seconds (a hung daemon), so an orchestrator can restart it.
    """

    def __init__(self, stall_after: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._marks: dict[str, tuple[bool, str]] = {}
        self._probes: dict[str, Callable[[], Any]] = {}
        self.stall_after, self._clock = stall_after, clock
        self._last_tick: float | None = None

    def tick(self) -> None:
        """The daemon's loop went round once."""
        self._last_tick = self._clock()

    def alive(self) -> tuple[bool, str]:
        """``(alive, detail)``: False only when the loop stopped ticking for ``stall_after`` seconds."""
        if self.stall_after is None or self._last_tick is None:
            return True, "ok"
        idle = self._clock() - self._last_tick
        if idle > self.stall_after:
            return False, f"loop stalled: no iteration for {idle:.0f} s (limit {self.stall_after:g} s)"
        return True, "ok"

    def mark(self, name: str, ok: bool, detail: str = "") -> None:
        with self._lock:
            self._marks[name] = (bool(ok), detail)

    def add_probe(self, name: str, probe: Callable[[], Any]) -> None:
        with self._lock:
            self._probes[name] = probe

    def check(self) -> tuple[bool, dict[str, str]]:
        """``(ready, {condition: "ok" | why not})``; a daemon with no condition at all is ready."""
        with self._lock:
            marks, probes = dict(self._marks), dict(self._probes)
        report = {name: "ok" if ok else (detail or "not ready") for name, (ok, detail) in marks.items()}
        for name, probe in probes.items():
            try:
                report[name] = "ok" if probe() else "probe returned false"
            except Exception as exc:  # a probe failing is the answer, not an error of the server
                report[name] = f"{type(exc).__name__}: {exc}"
        return all(v == "ok" for v in report.values()), report


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        try:
            if path == "/metrics":
                encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
                self._send(200, encoder(self.server.registry), content_type)
            elif path == "/healthz":
                alive, detail = self.server.readiness.alive()
                self._send(200 if alive else 503, detail.encode() + b"\n", TEXT)
            elif path == "/readyz":
                ready, report = self.server.readiness.check()
                body = json.dumps({"ready": ready, "checks": report}).encode() + b"\n"
                self._send(200 if ready else 503, body, "application/json")
            else:
                self._send(404, b"not found: try /metrics, /healthz or /readyz\n", TEXT)
        except Exception:  # one bad scrape must not kill the server thread
            log.exception("http: error serving %s", path)
            self._send(500, b"internal error\n", TEXT)

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (signature of the base)
        log.debug("http %s - " + format, self.address_string(), *args)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], registry: CollectorRegistry, readiness: Readiness):
        self.registry = registry
        self.readiness = readiness
        if ":" in address[0]:  # an IPv6 address, e.g. "::" or "::1"
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)


class HealthServer:
    """Serves a registry and a readiness on ``host:port`` from a background thread.

    ``host`` defaults to loopback (``127.0.0.1``); ``0.0.0.0`` (or ``::``) listens on every interface.
    ``port=0`` picks a free port (see :attr:`port`). Use as a context manager or call
    :meth:`start` / :meth:`stop`.
    """

    def __init__(self, port: int, registry: CollectorRegistry | None = None,
                 readiness: Readiness | None = None, host: str = DEFAULT_HOST):
        if not 0 <= port <= 65535:
            raise ValueError(f"metrics port must be within 0..65535, got {port}")
        if not host or host != host.strip():
            raise ValueError(f"metrics host must be an address or host name, got {host!r}")
        self.registry = registry if registry is not None else CollectorRegistry()
        self.readiness = readiness if readiness is not None else Readiness()
        self.host, self._port = host, port
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self._server.server_address[1] if self._server else self._port

    @property
    def bound_host(self) -> str:
        """The address the socket is bound to (the host asked for, before ``start``)."""
        return str(self._server.server_address[0]) if self._server else self.host

    @property
    def bound(self) -> str:
        """The address the socket is bound to, as ``host:port`` (``[::1]:port`` for IPv6)."""
        host = self.bound_host
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    @property
    def url(self) -> str:
        """A URL to reach the server from this machine (loopback when it listens on every interface)."""
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    def start(self) -> HealthServer:
        try:
            self._server = _Server((self.host, self._port), self.registry, self.readiness)
        except OSError as exc:
            from batchinfer.ops.startup import PortInUseError

            why = exc.strerror or str(exc)
            if exc.errno == errno.EADDRINUSE:
                hint = "pick a free port with --metrics-port (or BATCHINFER_METRICS_PORT)"
            else:  # a name that does not resolve, an address this machine does not have
                hint = "give an address of this machine with --metrics-host (or BATCHINFER_METRICS_HOST)"
            raise PortInUseError(f"metrics port {self._port} on {self.host}: cannot listen ({why}); "
                                 f"{hint}") from exc
        # A short poll interval makes stop() quick; it costs ten idle wake-ups a second.
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.1,),
                                        name="batchinfer-http", daemon=True)
        self._thread.start()
        loopback = ipaddress.ip_address(self.bound_host).is_loopback
        log.info("serving /metrics, /healthz, /readyz on http://%s%s", self.bound,
                 "" if loopback else " (no authentication: anyone who can reach this address may read it)")
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> HealthServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(port: int | None, registry: CollectorRegistry, readiness: Readiness,
          host: str = DEFAULT_HOST) -> HealthServer | None:
    """Start a :class:`HealthServer` on ``host:port`` when ``port`` is set (``--metrics-port``,
    ``--metrics-host``); None otherwise."""
    if port is None:
        return None
    return HealthServer(port, registry, readiness, host).start()


def probe(url: str, timeout: float = 5.0) -> int:
    """0 when ``url`` answers 200, else 1 (prints why): the health check command of a container.

    ``python -m batchinfer.ops.httpserver http://127.0.0.1:9102/readyz`` needs no curl in the image.
    """
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return 0 if response.status == 200 else 1
    except urllib.error.HTTPError as exc:
        print(f"{url}: HTTP {exc.code}: {exc.read().decode(errors='replace').strip()}", file=sys.stderr)
    except (OSError, ValueError) as exc:
        print(f"{url}: {exc}", file=sys.stderr)
    return 1


__all__ = ["HealthServer", "Readiness", "probe", "serve"]

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m batchinfer.ops.httpserver URL   (exit 0 when URL answers 200)")
    sys.exit(probe(sys.argv[1]))
