"""The inputs and outputs the CLI names: result files (``results -o``, ``run -o``), dataset inputs
(the dataset options of ``submit`` and ``run``) and the ``nightly`` command, which reads a dataset
and writes one.

Result files: the format comes from the file name unless ``--format`` says it: ``.parquet`` /
``.pq`` is Parquet, ``.jsonl`` / ``.ndjson`` the rows' JSON lines; OpenAI batch output lines and
Anthropic result lines (also JSONL) only with ``--format openai`` / ``--format anthropic``. A name
that says neither, or a compressed one (``.gz``: nothing here writes compressed files), is refused
rather than guessed. An existing file is kept unless ``--force``. ``--error-file`` is written in
the output's format.

Dataset options (:func:`dataset_options`): a row filter (``--where``, ``--partition``), a template
that builds each row's request (``--prompt-template`` / ``--body-template``), input columns copied
into the results (``--keep-columns``) and a Hive-partitioned output (``--partition-by``). They are
checked before anything starts: a template that does not load, a filter that does not parse, is a
usage error (exit 2) naming the file and line, or the position.

``batchinfer nightly`` (:func:`nightly`): the partitions of a dataset that the output's manifests
do not cover yet, one job each (:mod:`batchinfer.client.nightly`), on the configured queue or all
in one (``--embedded``, the daemons ``run`` starts).
"""
from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from batchinfer.cli.context import (
    EXIT_INPUT,
    EXIT_INTERRUPTED,
    EXIT_JOB_FAILED,
    EXIT_OK,
    EXIT_TIMEOUT,
    Ctx,
    emit,
    global_options,
    handle_errors,
    json_option,
)

if TYPE_CHECKING:
    from batchinfer.client.nightly import NightlyPlan, NightlyReport
    from batchinfer.datasets.templates import RequestTemplate

_SUFFIXES = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl"}
COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".zstd")


def output_format(location: str, fmt: str | None, param_hint: str = "-o") -> str:
    """``fmt`` when given, else the format ``location``'s extension names; ``click.BadParameter``
    (exit 2) when it names none."""
    name = location.rstrip("/").rsplit("/", 1)[-1].lower()
    if fmt is not None:
        if name.endswith(COMPRESSED):
            raise click.BadParameter(f"{location}: compressed output is not written; write "
                                     f"{location.rsplit('.', 1)[0]} and compress it", param_hint=param_hint)
        return fmt
    for suffix in COMPRESSED:
        if name.endswith(suffix):
            raise click.BadParameter(f"{location}: compressed output is not written; write "
                                     f"{location[:-len(suffix)]} and compress it", param_hint=param_hint)
    ext = os.path.splitext(name)[1]
    if ext not in _SUFFIXES:
        raise click.BadParameter(f"{location}: cannot tell the format from the name (.parquet, .jsonl); "
                                 "pass --format parquet|jsonl|openai|anthropic", param_hint=param_hint)
    return _SUFFIXES[ext]


def exists(location: str) -> bool:
    """Whether a file is at ``location`` (a path, ``file://`` or a pyarrow URI); False when a remote
    filesystem cannot tell (the write then reports its own error)."""
    if "://" not in location:
        return os.path.lexists(location)
    try:
        from pyarrow import fs

        filesystem, path = fs.FileSystem.from_uri(location)
        return filesystem.get_file_info(path).type != fs.FileType.NotFound
    except Exception:  # no credentials, no network, an unknown scheme: do not block the write on it
        return False


def refuse_overwrite(location: str, force: bool) -> None:
    """Exit 2 with a message when a file is at ``location`` and ``force`` is not set."""
    if not force and exists(location):
        from batchinfer.cli.context import EXIT_USAGE, fail

        fail(EXIT_USAGE, f"{location} exists: pass --force to overwrite it, or choose another -o")


def check_error_file(error_file: str | None, output: str, fmt: str, force: bool) -> None:
    """``--error-file``: not OUTPUT itself, not compressed, and not an existing file unless ``force``
    (exit 2, before anything is written)."""
    if error_file is None:
        return
    if _same_place(error_file, output):
        raise click.BadParameter(f"{error_file}: the error file must not be OUTPUT itself",
                                 param_hint="--error-file")
    output_format(error_file, fmt, param_hint="--error-file")  # with fmt given: refuses compression only
    if not force and exists(error_file):
        from batchinfer.cli.context import EXIT_USAGE, fail

        fail(EXIT_USAGE, f"{error_file} exists: pass --force to overwrite it, or choose another --error-file")


def _same_place(a: str, b: str) -> bool:
    def place(location: str) -> str:
        if location.startswith("file://"):
            location = location[len("file://"):]
        return location if "://" in location else os.path.realpath(location)

    return place(a) == place(b)


# -- dataset options (`submit`, `run`, `nightly`) ---------------------------------------------------

DATASET_NAMES = ("where", "partitions", "prompt_template", "body_template", "prompt_as", "keep_columns",
                 "partition_by")
PROMPT_AS = ("auto", "messages", "prompt", "input")


@dataclass
class DatasetArgs:
    """The dataset options as given, checked: what :meth:`submit_kwargs` hands to ``Client.submit``."""

    where: str | None = None
    partitions: tuple[str, ...] = ()
    template: RequestTemplate | None = None
    keep_columns: list[str] | None = None
    partition_by: list[str] | None = None

    @property
    def given(self) -> bool:
        """Whether any dataset option was given (the input is then read as a dataset)."""
        return bool(self.where or self.partitions or self.template or self.keep_columns or self.partition_by)

    def submit_kwargs(self) -> dict[str, Any]:
        """``Client.submit``'s dataset arguments, only those given."""
        given = {"where": self.where, "partitions": list(self.partitions), "template": self.template,
                 "keep_columns": self.keep_columns, "partition_by": self.partition_by}
        return {k: v for k, v in given.items() if v}

    @classmethod
    def parse(cls, *, where: str | None, partitions: tuple[str, ...], prompt_template: str | None,
              body_template: str | None, prompt_as: str, keep_columns: str | None,
              partition_by: str | None) -> DatasetArgs:
        """Check and load the options; ``click.UsageError`` / ``BadParameter`` (exit 2) naming the
        option and, for a template, the file and line."""
        from batchinfer.datasets.filters import RowFilter, partition_filter
        from batchinfer.datasets.templates import RequestTemplate, TemplateError

        if prompt_template and body_template:
            raise click.UsageError("--prompt-template and --body-template exclude each other: a body "
                                   "template renders the whole request, its prompt too")
        if prompt_as != "auto" and not prompt_template:
            raise click.UsageError("--prompt-as says how a --prompt-template's text is sent: give one")
        if where:
            try:
                RowFilter.parse(where)
            except ValueError as e:
                raise click.BadParameter(str(e), param_hint="--where") from None
        try:
            partition_filter(partitions)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--partition") from None
        template = None
        for path, kind, hint in ((prompt_template, "prompt", "--prompt-template"),
                                 (body_template, "body", "--body-template")):
            if path:
                try:
                    template = RequestTemplate.from_file(path, kind, prompt_as=prompt_as)
                except TemplateError as e:
                    raise click.BadParameter(_template_error(str(e), path), param_hint=hint) from None
        return cls(where=where or None, partitions=tuple(partitions), template=template,
                   keep_columns=_columns(keep_columns, "--keep-columns"),
                   partition_by=_columns(partition_by, "--partition-by"))


def _template_error(message: str, path: str) -> str:
    """A template's error naming the file as given (the message names its base name)."""
    name = Path(path).name
    return f"{path}{message[len(name):]}" if message.startswith(name) and path != name else message


def _columns(text: str | None, hint: str) -> list[str] | None:
    """``a,b`` as a list of column names; None when not given."""
    if text is None:
        return None
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise click.BadParameter(f"{text!r}: give column names, comma-separated (a,b)", param_hint=hint)
    return list(dict.fromkeys(names))


def dataset_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The dataset options of ``submit``, ``run`` and ``nightly``, handed to the command as one
    ``dataset`` argument (a checked :class:`DatasetArgs`). Put it below the command's other options."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        given = {k: kwargs.pop(k) for k in DATASET_NAMES}
        return fn(*args, dataset=DatasetArgs.parse(**given), **kwargs)

    options = [
        click.option("--where", metavar="EXPR",
                     help="Only the rows this filter keeps: \"date = '2026-12-03' AND lang IN ('en', 'de')\" "
                          "(=, !=, <, <=, >, >=, IN, IS NULL, AND, OR, NOT; DATE '...'). A filter on "
                          "partition keys skips the other partitions' files."),
        click.option("--partition", "partitions", multiple=True, metavar="KEY=VALUE",
                     help="Only this Hive partition (repeatable: different keys AND, the same key OR)."),
        click.option("--prompt-template", "--template", "prompt_template", metavar="FILE",
                     help="A jinja2 file rendering each row's prompt from its columns ({{ title }}); "
                          "a chat model gets it as the user message."),
        click.option("--body-template", "body_template", metavar="FILE",
                     help="A jinja2 file rendering each row's whole JSON request body (messages, "
                          "sampling fields, response_format)."),
        click.option("--prompt-as", "prompt_as", type=click.Choice(PROMPT_AS), default="auto",
                     show_default=True,
                     help="How the prompt template's text is sent: auto (messages for a chat model, "
                          "input for an embedding model, else prompt), messages, prompt, input."),
        click.option("--keep-columns", "keep_columns", metavar="A,B",
                     help="Input columns copied, with their types, into every result row (to join back)."),
        click.option("--partition-by", "partition_by", metavar="A,B",
                     help="Write the results as a Hive-partitioned dataset on these input columns under "
                          "the output folder or URI, with a manifest (kept automatically)."),
    ]
    for decorate in reversed(options):
        wrapper = decorate(wrapper)
    return wrapper


# -- nightly ---------------------------------------------------------------------------------------

pass_ctx = click.make_pass_decorator(Ctx)
READY_TIMEOUT_S = 600.0  # --embedded: how long the worker may take to load before the first job


@click.command()
@global_options
@click.option("--input", "input_", required=True, metavar="URI",
              help="The dataset: a folder (Hive partitions discovered), a glob, or a URI (s3://, gs://, "
                   "file://); S3 through the AWS environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...).")
@click.option("-o", "--output", required=True, metavar="URI",
              help="The result dataset's root: a folder or URI the queue may write (on the configured queue "
                   "a path inside BATCHINFER_RESULTS_ROOT or a URI under BATCHINFER_OUTPUT_URI_PREFIXES).")
@click.option("--model", required=True,
              help="The model: on the configured queue a name its workers serve; with --embedded as `run` "
                   "takes it (demo, tiny, a model folder, a .gguf file).")
@click.option("--format", "fmt", type=click.Choice(["parquet", "jsonl"]), default="parquet",
              show_default=True, help="The result files' format.")
@click.option("--embedded", is_flag=True,
              help="All in one, as `run`: an embedded Redis (unless --redis-url), scheduler, worker(s), "
                   "exporter, stopped at the end.")
@click.option("--device", help="--embedded: the workers' device [cuda:0 when available, else cpu].")
@click.option("--workers", "num_workers", type=click.IntRange(min=1), default=1, show_default=True,
              help="--embedded: worker processes.")
@click.option("--echo", is_flag=True, help="--embedded: echo engine instead of the model (no generation).")
@click.option("--logs", "log_dir", type=click.Path(file_okay=False),
              help="--embedded: keep the daemons' logs here.")
@click.option("--timeout", type=float, help="Stop waiting after this many seconds (exit 6; the jobs go on).")
@dataset_options
@json_option
@pass_ctx
@handle_errors
def nightly(ctx: Ctx, input_: str, output: str, model: str, fmt: str, embedded: bool, device: str | None,
            num_workers: int, echo: bool, log_dir: str | None, timeout: float | None, dataset: DatasetArgs,
            json_flag: bool) -> None:
    """Process the partitions (or files) of INPUT that OUTPUT's manifests do not cover yet, one job
    each, and wait for them: exit 0 when every unit is written, else as `wait` (5 a job failed,
    6 --timeout, 7 the input cannot be read or lacks a --keep-columns / --partition-by column).
    The results are a dataset under OUTPUT: --partition-by is required.

    A partition whose files changed (added, removed, resized) is processed again. Safe to start
    twice at once against one queue: the jobs' ids come from the partitions and OUTPUT, so the second run
    waits for the first one's jobs instead of submitting them again. Interrupted, the jobs go on
    (on the configured queue): the next run joins them."""
    from batchinfer.datasets.source import DatasetSource
    from batchinfer.protocol.destinations import check_output

    if dataset.template is None:
        raise click.UsageError("nightly needs --prompt-template (--template) or --body-template")
    if not dataset.partition_by:
        raise click.UsageError("nightly writes a dataset: give --partition-by COLUMN[,..]")
    if not embedded and (device or echo or log_dir or num_workers != 1):
        raise click.UsageError("--device, --workers, --echo and --logs go with --embedded")
    quiet = ctx.quiet or ctx.json or json_flag
    say = (lambda msg: None) if quiet else (lambda msg: click.echo(msg, err=True))
    if embedded:  # the daemons are ours: a local output is its file:// URI, allowed to them
        output = output if "://" in output else Path(output).resolve().as_uri()
        check_output(output, ctx.settings.results_root, output)  # no query, credentials, '..': exit 2
        ctx.settings.output_uri_prefixes = ",".join(filter(None, [ctx.settings.output_uri_prefixes, output]))
    else:  # the operator's daemons: their destination rule, checked here first (exit 2)
        if "://" not in output:
            output = os.path.abspath(os.path.join(ctx.settings.results_root, output))
        check_output(output, ctx.settings.results_root, ctx.settings.output_uri_prefixes)
    source = DatasetSource(input_, where=dataset.where, partitions=dataset.partitions)
    options: dict[str, Any] = {"model": model, "template": dataset.template,
                               "keep_columns": dataset.keep_columns, "partition_by": dataset.partition_by,
                               "output_format": fmt, "timeout": timeout, "say": say}
    if embedded:
        report = _nightly_embedded(ctx, source, output, options, device=device, num_workers=num_workers,
                                   echo=echo, log_dir=log_dir, say=say)
    else:
        from batchinfer.client.nightly import run_nightly

        plan = _plan(source, output, options)  # a bad column: exit 7 before Redis is asked anything
        with ctx.client() as client:
            report = run_nightly(client, source, output, **options, plan=plan)
    emit(ctx, json_flag, report.to_dict(), lambda: click.echo(nightly_text(report)))
    if report.timed_out:
        running = sum(1 for u in report.units if u.status and not u.written and u not in report.failed)
        say(f"timed out after {timeout or 0:g} s: {running} job(s) still running; a rerun joins them")
    sys.exit(nightly_exit_code(report))


def _nightly_embedded(ctx: Ctx, source: Any, output: str, options: dict[str, Any], *, device: str | None,
                      num_workers: int, echo: bool, log_dir: str | None,
                      say: Callable[[str], None]) -> NightlyReport:
    """``nightly --embedded``: the daemons ``run`` starts, the nightly run on them, everything stopped."""
    from batchinfer.cli.daemons import default_device
    from batchinfer.cli.runner import (
        INTERRUPT_GRACE_S,
        DaemonExited,
        Stopped,
        daemon_exited,
        start_daemons,
        start_embedded,
        trap_sigterm,
    )
    from batchinfer.client.client import Client
    from batchinfer.client.nightly import run_nightly

    plan = _plan(source, output, options)
    if not plan.todo:  # nothing to do: no Redis, no daemons, no model to load
        return run_nightly(None, source, output, **options, plan=plan)
    device = device or default_device()
    with contextlib.ExitStack() as stack:  # closed in reverse: client, daemons, logs, Redis, SIGTERM
        trap_sigterm(stack)
        started = start_embedded(stack, ctx, options["model"], log_dir=log_dir, say=say)
        try:
            start_daemons(started.daemons, started.model_path, started.served, num_workers=num_workers,
                          device=device, echo=echo)
            say(f"started scheduler, {num_workers} worker(s) ({started.served[0]} on {device}), exporter; "
                f"logs in {started.logs.path}")
            client = stack.enter_context(Client(settings=ctx.settings))
            _await_worker(client, started.served[0], started.daemons.check, say)
            report = run_nightly(client, source, output, **{**options, "model": started.served[0]},
                                 check=started.daemons.check, plan=plan)
        except DaemonExited as e:
            sys.exit(daemon_exited(e, started.daemons, started.logs))
        except (KeyboardInterrupt, Stopped):
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the stop short
            stack.callback(signal.signal, signal.SIGINT, signal.default_int_handler)
            click.echo("stopping...", err=True)
            started.daemons.stop(INTERRUPT_GRACE_S)
            started.logs.keep = True
            click.echo(f"logs kept in {started.logs.path}", err=True)
            sys.exit(EXIT_INTERRUPTED)
        if not report.written:
            started.logs.keep = True
            click.echo(f"{started.daemons.tails()}\nlogs kept in {started.logs.path}", err=True)
    return report


def _plan(source: Any, output: str, options: dict[str, Any]) -> NightlyPlan:
    """The nightly plan, its kept and partition columns checked against the input's columns when
    there is a unit to do: exit 7 naming them before Redis, the daemons or the model start."""
    from batchinfer.client.nightly import check_columns, plan_nightly

    plan = plan_nightly(source, output)
    if plan.todo:
        check_columns(source, options["keep_columns"], options["partition_by"])
    return plan


def _await_worker(client: Any, model: str, check: Callable[[], None], say: Callable[[str], None],
                  timeout: float = READY_TIMEOUT_S) -> None:
    """Wait until a worker serves ``model``: a prompt template's "auto" is resolved against the
    model's registration, which its worker writes once loaded."""
    import time

    deadline = time.monotonic() + timeout
    said = False
    while not client.workers(model):
        check()
        if time.monotonic() >= deadline:
            raise TimeoutError(f"no worker served {model} after {timeout:g} s")
        if not said:
            say(f"waiting for the worker to load {model}...")
            said = True
        time.sleep(0.2)


def nightly_exit_code(report: NightlyReport) -> int:
    """0 when every unit is written; else 7 (a unit's input unreadable), 5 (a job ended without
    writing its unit) or 6 (the timeout passed first), in that order."""
    if report.input_errors:
        return EXIT_INPUT
    if report.failed:
        return EXIT_JOB_FAILED
    if not report.written:
        return EXIT_TIMEOUT
    return EXIT_OK


def nightly_text(report: NightlyReport) -> str:
    """One line per unit: its name, what was done, the job's status and id, its rows or error."""
    if not report.units:
        return f"{report.input}: no partition or file to process"
    width = max(len(u.name) for u in report.units)
    lines = []
    for u in report.units:
        if u.action == "skipped":
            lines.append(f"{u.name:<{width}}  skipped    up to date")
            continue
        detail = u.error or (f"{u.rows} rows" + (f" ({u.failed_rows} failed)" if u.failed_rows else "")
                             if u.rows is not None else "")
        line = f"{u.name:<{width}}  {u.action:<9}  {u.status or '-':<11}  {u.job_id}  {detail}"
        lines.append(line.rstrip())
    return "\n".join(lines)
