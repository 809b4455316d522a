"""``batchinfer run``: Redis (embedded unless a URL is given), the three daemons, one job, clean stop.

The daemons run as subprocesses (``python -m batchinfer.cli scheduler|worker|exporter``), as
they would in production: each has its own signal handling and memory, a crash in one shows up
as an exit code instead of taking the others down, and stopping them is a SIGTERM each. Their
logs go to files (a temporary folder unless ``--logs``) so they do not fight the progress bar;
when something fails, the tails are printed. Everything started is stopped on the way out —
normal end, error, or Ctrl-C.

Redis is an embedded one unless ``--redis-url`` is given on the command line:
``BATCHINFER_REDIS_URL`` in the environment does not move ``run`` onto a shared Redis. One line
says which Redis it uses.

Ctrl-C (or SIGTERM) and ``--timeout`` say so at once, cancel the job (wherever it runs) and let
the scheduler answer what is left with ``cancelled`` rows, stop the daemons within a few seconds
(SIGTERM, a short grace, SIGTERM again, which stops a worker without draining, then SIGKILL),
write the job's rows (one per line, the unfinished ones ``cancelled``) to the output file (as
OpenAI does for cancelled and expired batches) unless ``--no-partial``, and keep the logs folder.
With ``--error-file``, the rows that did not complete go to that file instead: the job is submitted
with it as its ``error_output``, so its exporter writes OpenAI's two files in one pass, each
atomically (the completed rows to the output file, the others to the error file).
The daemons and the embedded Redis run in their own sessions, so the terminal's Ctrl-C reaches
``run`` alone and Redis stays up long enough for the partial results to be read.
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from batchinfer.cli.context import Ctx
    from batchinfer.config import Settings

STOP_TIMEOUT_S = 30.0  # after the job ended: let the daemons finish cleanly
EXPORT_WAIT_S = 30.0  # --error-file, a job ended unexported (expired): how long its export is awaited
INTERRUPT_GRACE_S = 2.0  # after Ctrl-C / --timeout: SIGTERM, this long, SIGTERM again, 1 s, SIGKILL
CANCEL_SETTLE_S = 10.0  # after Ctrl-C / --timeout: how long the cancelled job may take to settle
CANCEL_POLL_S = 0.1
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
    # --error-file, the job's error_output (a URI for a local path, as ``output``): the rows that did
    # not complete go there, not to ``output``
    error_file: str | None = None
    # the dataset options' Client.submit arguments (template, keep_columns, partition_by, where, ...)
    dataset: dict[str, Any] = field(default_factory=dict)


def check_input(file: str, *, where: str | None = None, partitions: Sequence[str] = ()) -> None:
    """``InputError`` (exit 7, as ``submit``) unless ``file`` can be read: before anything starts.

    What ``Client.submit`` reads as a dataset (a folder, a glob, a URI: ``is_dataset``, with or
    without dataset options) is listed here with the row filter's partition part, so an empty
    folder, a filter that matches no file or an unreachable bucket fails before a daemon starts;
    a file must exist and be readable."""
    from batchinfer.client.inputs import InputError, is_dataset

    if is_dataset(file):
        from batchinfer.datasets.source import DatasetSource

        DatasetSource(file, where=where, partitions=partitions).files()
        return
    path = Path(file)
    if not path.exists():
        raise InputError(f"{path}: no such file")
    if not os.access(path, os.R_OK):
        raise InputError(f"{path}: cannot be read: permission denied")


class DaemonExited(RuntimeError):
    """A daemon ``run`` started exited before the job ended."""


def tiny_model(root: Path | None = None) -> Path:
    """The tiny random model (``--model tiny``), built once and cached (see
    :func:`batchinfer.workers.models.demo.tiny_model`)."""
    from batchinfer.workers.models.demo import tiny_model as build

    return build(root)


def resolve_model(model: str) -> tuple[Path, str]:
    """``--model``'s checkpoint and the name it is served under [by default]: the names every
    command accepts (``demo``, ``tiny``, ``minilm`` or a path), see
    :func:`batchinfer.workers.models.demo.resolve_model`; a ``click.BadParameter`` when unusable.
    """
    from batchinfer.workers.models.demo import resolve_model as resolve

    try:
        return resolve(model)
    except (ValueError, FileNotFoundError) as e:  # UnknownModel, or a demo package not installed
        raise click.BadParameter(str(e), param_hint="--model") from None


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

    def stop(self, grace: float | None = None, only: str | None = None) -> None:
        """SIGTERM every daemon (``only``: that one) and wait for them (workers drain), SIGKILL
        what is left.

        ``grace`` (after Ctrl-C / --timeout): wait only that long, then SIGTERM again (a worker's
        second signal stops it without draining), 1 s more, then SIGKILL: done in seconds.
        """
        procs = [p for name, p in self.procs.items() if only is None or name == only]
        self._signal(signal.SIGTERM, procs)
        if grace is None:
            self._wait(STOP_TIMEOUT_S, procs)
        else:
            self._wait(grace, procs)
            self._signal(signal.SIGTERM, procs)
            self._wait(1.0, procs)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)

    def _signal(self, sig: signal.Signals, procs: list[subprocess.Popen]) -> None:
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(sig)

    def _wait(self, seconds: float, procs: list[subprocess.Popen]) -> None:
        deadline = time.monotonic() + seconds
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.05, deadline - time.monotonic()))

    def tails(self) -> str:
        parts = []
        for name, path in self.logs.items():
            with contextlib.suppress(OSError):
                lines = path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
                parts.append(f"--- {name} ({path}) ---\n" + "\n".join(lines))
        return "\n".join(parts)


class Stopped(Exception):
    """SIGTERM reached ``run`` (or ``nightly --embedded``): stop as on Ctrl-C."""


def _raise_stopped(signum: int, frame: object) -> None:
    raise Stopped()


def trap_sigterm(stack: contextlib.ExitStack) -> None:
    """SIGTERM raises :class:`Stopped` until ``stack`` closes (the daemons are then stopped as on Ctrl-C)."""
    previous = signal.signal(signal.SIGTERM, _raise_stopped)
    stack.callback(signal.signal, signal.SIGTERM, previous)


@dataclass
class Embedded:
    """What :func:`start_embedded` set up: the daemons (not started yet), their logs, the served names."""

    daemons: Daemons
    logs: LogFolder
    model_path: Path
    served: list[str]  # the first is the job's model


def start_embedded(stack: contextlib.ExitStack, ctx: Ctx, model: str,
                   served_model_names: tuple[str, ...] = (), *, log_dir: str | None,
                   say: Callable[[str], None]) -> Embedded:
    """``--model`` resolved, Redis (embedded unless ``--redis-url``), the log folder and the daemons'
    launcher, each undone by ``stack`` (``run`` and ``nightly --embedded``); start them with
    :func:`start_daemons`. ``ctx.settings.output_uri_prefixes`` must already hold the run's outputs."""
    model_path, default_name = resolve_model(model)
    redis_url = start_redis(stack, ctx.settings, ctx.given.get("redis_url"), say)
    logs = LogFolder.open(stack, log_dir)
    daemons = Daemons(logs.path, daemon_env(ctx.settings, redis_url))
    stack.callback(daemons.stop)
    return Embedded(daemons, logs, model_path, list(dict.fromkeys(served_model_names)) or [default_name])


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
    with contextlib.ExitStack() as stack:  # closed in reverse: client, daemons, logs, Redis, SIGTERM
        trap_sigterm(stack)
        embedded = start_embedded(stack, ctx, opts.model, opts.served_model_names, log_dir=opts.log_dir,
                                  say=say)
        daemons, logs, served = embedded.daemons, embedded.logs, embedded.served
        client: Any = None
        job: str | None = None
        try:
            start_daemons(daemons, embedded.model_path, served, num_workers=opts.num_workers,
                          device=opts.device, echo=opts.echo, worker_args=opts.worker_args)
            say(f"started scheduler, {opts.num_workers} worker(s) ({served[0]} on {opts.device}), exporter; "
                f"logs in {logs.path}")
            client = stack.enter_context(Client(settings=ctx.settings))
            job = _submit(client, opts, served[0])
            say(f"job {job}")
            try:
                wait(client, job, daemons.check)
            except SystemExit:  # the job ended without completing: its two files all the same
                try:
                    _await_error_file(client, job, opts, say)
                except Exception as e:  # the exit code says the job failed; say why the file did too
                    click.echo(f"could not write the error file of job {job}: {e}", err=True)
                raise
            _await_error_file(client, job, opts, say)
        except DaemonExited as e:
            return daemon_exited(e, daemons, logs)
        except (KeyboardInterrupt, Stopped, TimeoutError) as e:
            submitted = (client, job) if job is not None else None
            return _interrupted(e, stack, daemons, logs, submitted, opts)
        except SystemExit:  # the job ended but did not complete
            logs.keep = True
            click.echo(f"{daemons.tails()}\nlogs kept in {logs.path}", err=True)
            raise
    return 0


@dataclass
class LogFolder:
    """The daemons' log folder: ``--logs`` (always kept) or a temporary one, removed on the way
    out after a run that ends normally, kept after a failure, an interrupt or a timeout."""

    path: Path
    keep: bool

    @classmethod
    def open(cls, stack: contextlib.ExitStack, log_dir: str | None) -> LogFolder:
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


def start_redis(stack: contextlib.ExitStack, settings: Settings, given_url: str | None,
                say: Callable[[str], None]) -> str:
    """The run's Redis URL: ``--redis-url`` as given on the command line, else an embedded Redis's
    (stopped with ``stack``); one line says which.

    ``BATCHINFER_REDIS_URL`` alone does not move ``run``: exported for the daemons of a deployment,
    it would put a second scheduler and worker beside theirs, on their Redis, unannounced.
    """
    from batchinfer.cli.embedded import EmbeddedRedis
    from batchinfer.redis_conn import describe

    if given_url:
        settings.redis_url = given_url
        say(f"redis: {describe(given_url)} (--redis-url)")
        return given_url
    from_env = settings.redis_url
    embedded = stack.enter_context(EmbeddedRedis())
    settings.redis_url = embedded.url
    note = (f" (BATCHINFER_REDIS_URL={describe(from_env)} is not used by run: pass --redis-url to run there)"
            if from_env else "")
    say(f"redis: embedded redis-server on {embedded.url}{note}")
    return embedded.url


def daemon_env(settings: Settings, redis_url: str) -> dict[str, str]:
    """The daemons' environment: this one plus the run's settings."""
    # The URL travels in the environment, not argv, so no password shows in `ps`.
    env = {**os.environ, "BATCHINFER_REDIS_URL": redis_url, "BATCHINFER_PREFIX": settings.prefix,
           "BATCHINFER_LOG_FORMAT": settings.log_format, "BATCHINFER_LOG_LEVEL": settings.log_level}
    if settings.redis_ca_file:  # given as a flag: the daemons need it too
        env["BATCHINFER_REDIS_CA_FILE"] = settings.redis_ca_file
    if settings.output_uri_prefixes:  # with the run's own output (`run` adds it)
        env["BATCHINFER_OUTPUT_URI_PREFIXES"] = settings.output_uri_prefixes
    return env


def start_daemons(daemons: Daemons, model_path: Path, served: list[str], *, num_workers: int, device: str,
                  echo: bool = False, worker_args: tuple[str, ...] = ()) -> None:
    """The scheduler, ``num_workers`` workers serving ``served`` names (``batchinfer worker``'s
    ``worker_args`` added), the exporter (``run`` and ``serve``)."""
    names = [a for name in served for a in ("--served-model-name", name)]
    daemons.start("scheduler", "scheduler")
    for i in range(num_workers):
        args = ["worker", "--model", str(model_path), "--name", f"run-{os.getpid()}-{i}",
                "--device", device, *names, *worker_args]
        daemons.start(f"worker-{i}", *args, *(["--echo"] if echo else []))
    daemons.start("exporter", "exporter")


def _submit(client: Any, opts: RunOptions, model: str) -> str:
    """Submit ``opts.file`` as one job of ``model``; its id."""
    output = opts.output if "://" in opts.output else os.path.abspath(opts.output)
    # the job's model (served[0]) answers every line, whatever model the line names
    return client.submit(opts.file, model=model, output=output, output_format=opts.fmt,
                         input_column=opts.input_column, error_output=opts.error_file, **opts.dataset)


def _await_error_file(client: Any, job: str, opts: RunOptions, say: Callable[[str], None],
                      wait_s: float = EXPORT_WAIT_S) -> None:
    """``--error-file``: the job's exporter writes both files (its ``error_output``). A job that ended
    before its export ran (``expired``: it ends before its last rows are in, and so before its
    export) is given ``wait_s`` for it; past that, or when the export failed, both files are
    written here from the job's rows (still in Redis), as its exporter would have."""
    from batchinfer.store.jobstore import JobStatus

    if opts.error_file is None:
        return
    deadline = time.monotonic() + wait_s
    record = client.status(job)
    while record.exported_at is None and record.status != JobStatus.FAILED and time.monotonic() < deadline:
        time.sleep(CANCEL_POLL_S)
        record = client.status(job)
    if record.exported_at is None:
        client.write_results(job, opts.output, opts.fmt, error_file=opts.error_file)
    say(f"error rows in {opts.error_file}")


def daemon_exited(e: DaemonExited, daemons: Daemons, logs: LogFolder) -> int:
    """A daemon died before the job ended: say which, with the logs' tails (kept)."""
    from batchinfer.cli.context import EXIT_DAEMON

    click.echo(f"error: {e}\n{daemons.tails()}", err=True)
    logs.keep = True
    return EXIT_DAEMON


def _interrupted(e: BaseException, stack: contextlib.ExitStack, daemons: Daemons, logs: LogFolder,
                 submitted: tuple[Any, str] | None, opts: RunOptions) -> int:
    """Ctrl-C, SIGTERM or ``--timeout``: stop the daemons in seconds, write the rows so far of the
    ``(client, job)`` submitted (unless ``--no-partial``), keep the logs."""
    from batchinfer.cli.context import EXIT_INTERRUPTED, EXIT_TIMEOUT

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
    stack.callback(signal.signal, signal.SIGINT, signal.default_int_handler)
    timed_out = isinstance(e, TimeoutError)
    click.echo(f"{e}; stopping..." if timed_out else "stopping...", err=True)
    if submitted is not None:
        if not opts.partial:  # its exporter would write the cancelled job's rows to OUTPUT
            daemons.stop(INTERRUPT_GRACE_S, only="exporter")
        _cancel(*submitted)
    daemons.stop(INTERRUPT_GRACE_S)
    logs.keep = True
    if submitted is not None and opts.partial:
        _write_partial(*submitted, opts)
    click.echo(f"logs kept in {logs.path}", err=True)
    return EXIT_TIMEOUT if timed_out else EXIT_INTERRUPTED


def _cancel(client: Any, job: str, settle_s: float = CANCEL_SETTLE_S) -> None:
    """Cancel ``job`` wherever it runs (the embedded Redis or ``--redis-url``'s) and give the
    scheduler and workers, still running, up to ``settle_s`` to answer what is left with
    ``cancelled`` rows, so the partial file has a row for every line, as ``batchinfer cancel`` gives."""
    import redis

    from batchinfer.client.client import JobNotFound

    try:
        client.cancel(job)
        deadline = time.monotonic() + settle_s
        while not _settled(client.status(job)):
            if time.monotonic() >= deadline:
                click.echo(f"job {job} is still cancelling after {settle_s:g} s", err=True)
                return
            time.sleep(CANCEL_POLL_S)
    except (redis.RedisError, JobNotFound) as e:
        click.echo(f"could not cancel job {job}: {e}", err=True)
        return
    click.echo(f"cancelled job {job}", err=True)


def _settled(record: Any) -> bool:
    """Whether every request of the job has its row (ended, or waiting only for its export)."""
    return record.terminal or (record.total is not None and record.done >= record.total)


def _write_partial(client: Any, job: str, opts: RunOptions) -> None:
    """The job's rows so far to ``opts.output`` (one line on stderr says how many, and where)."""
    import redis

    count = [0]

    def counted() -> None:
        count[0] += 1

    try:
        location = client.write_results(job, opts.output, opts.fmt, on_row=counted,
                                        error_file=opts.error_file)
    except (redis.RedisError, OSError, ValueError) as e:
        click.echo(f"could not write the partial results of job {job}: {e}", err=True)
        return
    total = client.status(job).total
    click.echo(f"wrote the results so far ({count[0]} of {total if total is not None else '?'} rows) "
               f"to {location}", err=True)
