"""The API's process: what ``batchinfer api`` runs (batchinfer/cli/api.py is the command).

:func:`main` serves :func:`batchinfer.api.app.create_app` with uvicorn, as the other daemons' ``main``
serve their loops: logging through batchinfer's setup (uvicorn's own access log off: the app writes
one, naming keys, never secrets); the port is bound first, so one taken is a one-line start-up
error (exit 9); SIGTERM or Ctrl-C stops it gracefully (no new connections, requests in flight get
:data:`GRACEFUL_SHUTDOWN_S`) with exit code 0. ``workers`` > 1 runs that many processes on the one
socket (uvicorn's supervisor); each builds its app from the environment
(:func:`batchinfer.api.app.app_from_env`), where :func:`main` puts the settings its command line set.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import signal
import socket
from typing import Any

from batchinfer.api.app import create_app
from batchinfer.config import Settings
from batchinfer.ops.startup import StartupError

log = logging.getLogger("batchinfer.api")

GRACEFUL_SHUTDOWN_S = 30  # after SIGTERM: requests in flight get this long, then are cancelled
# What `api` passes to the processes of --workers N through the environment (each builds its
# app from Settings.from_env()): the settings its command line may have changed.
EXPORTED_SETTINGS = ("redis_url", "redis_ca_file", "prefix", "log_format", "log_level", "api_auth")


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (or ``localhost``)."""
    if host == "localhost":
        return True
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(host).is_loopback
    return False


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (uvicorn serves on it); a StartupError naming the port when
    it cannot be had."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, port), family=family)
    except OSError as e:
        raise StartupError(f"cannot listen on {host}:{port}: {e.strerror or e}; another process may hold "
                           "the port: stop it or pick another with --port") from None
    # create_server leaves the socket's protocol 0, so asyncio does not set TCP_NODELAY on what it
    # accepts; uvicorn writes a reply's head and body apart, and the body then waits ~40 ms for the
    # client's delayed ACK on a kept-alive connection. Set on the listener, Linux passes it on.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def main(settings: Settings, *, host: str, port: int, workers: int = 1, ssl_keyfile: str | None = None,
         ssl_certfile: str | None = None) -> int:
    """``batchinfer api``: serve until SIGTERM / SIGINT (uvicorn, ``workers`` processes on one
    socket; TLS with both files given); returns the exit code."""
    import uvicorn

    sock = listen(host, port)
    common: dict[str, Any] = dict(host=host, port=port, log_config=None, access_log=False,
                                  server_header=False, ssl_keyfile=ssl_keyfile, ssl_certfile=ssl_certfile,
                                  lifespan="on", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    scheme = "https" if ssl_certfile else "http"
    log.info("serving the API on %s://%s:%d (auth: %s, %d process(es); redis %s; files in %s)", scheme, host,
             port, settings.api_auth, workers, settings.redacted_url() or "default", settings.files_root())
    if settings.api_auth == "none" and not is_loopback(host):
        log.warning("--auth none on %s: anyone who reaches this address can use the API without a key", host)
    if workers > 1:
        from uvicorn.supervisors import Multiprocess

        for name in EXPORTED_SETTINGS:
            value = getattr(settings, name)
            if value is not None:
                os.environ[f"BATCHINFER_{name.upper()}"] = str(value)
        config = uvicorn.Config("batchinfer.api.app:app_from_env", factory=True, workers=workers, **common)
        Multiprocess(config, sockets=[sock]).run()
        return 0
    server = uvicorn.Server(uvicorn.Config(create_app(settings), **common))
    # uvicorn raises the stopping signal again after its graceful stop: land it on a no-op, so a
    # SIGTERM ends the process with 0, as it ends the other daemons
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: None)
    server.run(sockets=[sock])
    if not server.started:
        raise StartupError("the API did not start: the reason is logged above")
    return 0


__all__ = ["GRACEFUL_SHUTDOWN_S", "is_loopback", "listen", "main"]
