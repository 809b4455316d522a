"""``batchinfer run``: Redis (embedded unless a URL is given), the three daemons, one job, clean stop.

The daemons run as subprocesses (``python -m batchinfer.cli scheduler|worker|exporter``), as
they would in production: each has its own signal handling and memory, a crash in one shows up
as an exit code instead of taking the others down, and stopping them is a SIGTERM each. Their
logs go to files (a temporary folder unless ``--logs``) so they do not fight the progress bar;
when something fails, the tails are printed. Everything started is stopped on the way out —
normal end, error, or Ctrl-C.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from batchinfer.cli.context import Ctx

DEMO = "demo"
STOP_TIMEOUT_S = 30.0
LOG_TAIL_LINES = 25


@dataclass
class RunOptions:
    file: str
    output: str
    model: str  # a model folder, or "demo"
    fmt: str = "parquet"
    device: str = "cpu"
    num_workers: int = 1
    echo: bool = False
    timeout: float | None = None
    log_dir: str | None = None


class DaemonExited(RuntimeError):
    """A daemon ``run`` started exited before the job ended."""


def cache_dir() -> Path:
    """Where built artefacts are cached: ``$XDG_CACHE_HOME/batchinfer`` (default ``~/.cache``)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "batchinfer"


def demo_model(root: Path | None = None) -> Path:
    """The tiny random demo model, built once (torch + safetensors + tokenizers only) and cached.

    Built in a temporary folder and renamed into place, so concurrent runs never see half a model.
    """
    from batchinfer.workers.testing import make_demo_model

    target = (root or cache_dir() / "models") / DEMO
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".demo-", dir=target.parent))
    try:
        make_demo_model(tmp / DEMO)
        with contextlib.suppress(OSError):  # another run won the race: its copy is as good
            os.rename(tmp / DEMO, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model(model: str) -> Path:
    """A model folder: ``model`` itself when it is a folder, the demo model for ``"demo"``."""
    path = Path(model)
    if path.is_dir():
        return path.resolve()
    if model == DEMO:
        return demo_model()
    raise click.BadParameter(f"{model!r} is not a model folder (or 'demo')", param_hint="--model")


class Daemons:
    """Subprocesses started by ``run``, with their logs; stopped together."""

    def __init__(self, log_dir: Path, env: dict[str, str]):
        self.log_dir = log_dir
        self.env = env
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}

    def start(self, name: str, *args: str) -> None:
        log_path = self.log_dir / f"{name}.log"
        with open(log_path, "ab") as log_file:  # the child keeps its own descriptor
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "batchinfer.cli", *args], env=self.env, stdin=subprocess.DEVNULL,
                stdout=log_file, stderr=subprocess.STDOUT)
        self.logs[name] = log_path

    def check(self) -> None:
        """Raise :class:`DaemonExited` if any daemon has exited."""
        for name, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                raise DaemonExited(f"{name} exited with code {code}")

    def stop(self) -> None:
        """SIGTERM every daemon, wait for them (workers drain), SIGKILL what is left."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)

    def tails(self) -> str:
        parts = []
        for name, path in self.logs.items():
            with contextlib.suppress(OSError):
                lines = path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
                parts.append(f"--- {name} ({path}) ---\n" + "\n".join(lines))
        return "\n".join(parts)


def run_all(ctx: Ctx, opts: RunOptions,
            wait: Callable[[Any, str, Callable[[], None]], None]) -> int:
    """Start what is needed, submit ``opts.file``, ``wait(client, job, check)``, stop; an exit code.

    ``wait`` raises ``SystemExit`` for a job that did not complete (the CLI's exit codes);
    ``check`` raises :class:`DaemonExited` when a daemon died.
    """
    from batchinfer.cli.context import EXIT_DAEMON
    from batchinfer.cli.embedded import EmbeddedRedis
    from batchinfer.client.client import Client

    settings = ctx.settings
    say = (lambda msg: None) if ctx.quiet or ctx.json else (lambda msg: click.echo(msg, err=True))
    if opts.num_workers < 1:
        raise click.BadParameter("must be >= 1", param_hint="--workers")
    with contextlib.ExitStack() as stack:
        model_dir = resolve_model(opts.model)
        if not settings.redis_url:
            embedded = stack.enter_context(EmbeddedRedis())
            settings.redis_url = embedded.url
            say(f"embedded Redis on {embedded.url}")
        if opts.log_dir:
            log_dir = Path(opts.log_dir)
            log_dir.mkdir(parents=True, exist_ok=True)
        else:
            log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="batchinfer-run-")))
        # The URL travels in the environment, not argv, so no password shows in `ps`.
        env = {**os.environ, "BATCHINFER_REDIS_URL": settings.redis_url, "BATCHINFER_PREFIX": settings.prefix,
               "BATCHINFER_LOG_FORMAT": settings.log_format, "BATCHINFER_LOG_LEVEL": settings.log_level}
        if settings.redis_ca_file:  # given as a flag: the daemons need it too
            env["BATCHINFER_REDIS_CA_FILE"] = settings.redis_ca_file
        daemons = Daemons(log_dir, env)
        stack.callback(daemons.stop)
        daemons.start("scheduler", "scheduler")
        for i in range(opts.num_workers):
            args = ["worker", "--model", str(model_dir), "--name", f"run-{os.getpid()}-{i}",
                    "--device", opts.device]
            daemons.start(f"worker-{i}", *args, *(["--echo"] if opts.echo else []))
        daemons.start("exporter", "exporter")
        say(f"started scheduler, {opts.num_workers} worker(s) ({model_dir.name} on {opts.device}), exporter; "
            f"logs in {log_dir}")
        client = stack.enter_context(Client(settings=settings))
        output = opts.output if "://" in opts.output else os.path.abspath(opts.output)
        try:
            job = client.submit(opts.file, model=model_dir.name, output=output, output_format=opts.fmt)
            say(f"job {job}")
            wait(client, job, daemons.check)
        except DaemonExited as e:
            click.echo(f"error: {e}\n{daemons.tails()}", err=True)
            return EXIT_DAEMON
        except SystemExit:
            if opts.log_dir is None:  # the logs are about to go away with their folder
                click.echo(daemons.tails(), err=True)
            raise
    return 0
