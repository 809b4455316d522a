"""The daemon commands of ``batchinfer``: ``scheduler``, ``worker``, ``exporter``.

Each is a thin launcher: command-line options onto :class:`~batchinfer.config.Settings`, then the
daemon's own ``main`` (imported late so that a command loads only its daemon), whose return value
is the exit code. :mod:`batchinfer.cli.main` adds these commands to its group; the group's
:class:`~batchinfer.cli.context.Ctx` arrives through ``click.pass_obj``.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

import click

from batchinfer.cli.context import global_options
from batchinfer.config import Settings
from batchinfer.workers.quantization_config import QUANTIZATION_MODES
from batchinfer.workers.tools import TOOL_PARSERS

if TYPE_CHECKING:
    from batchinfer.cli.context import Ctx

POSITIVE = click.IntRange(min=1)
PORT = click.IntRange(min=1, max=65535)
SECONDS = click.FloatRange(min=0, min_open=True)
log = logging.getLogger("batchinfer.cli")
# --quantization (worker, run): EngineConfig.quantization
quantization_option = click.option(
    "--quantization", type=click.Choice(QUANTIZATION_MODES),
    help="Weight-only quantization of the linear layers, CPU only: int8, int4 (both run in bfloat16), "
         "auto (a GGUF keeps its precision class: Q4_* int4, Q5_*/Q6_K/Q8_0 int8; else none) [none].")


def default_device() -> str:
    """``cuda:0`` when torch sees CUDA, else ``cpu`` (also without torch)."""
    try:
        import torch

        return "cuda:0" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


def run_daemon(main: Callable[..., int | None], *args: Any, **kwargs: Any) -> NoReturn:
    """Exit with ``main(*args, **kwargs)``'s code; a start-up error is one line on stderr and exit 9
    (EXIT_STARTUP), its traceback only in the DEBUG log."""
    from batchinfer.cli.context import EXIT_STARTUP, fail
    from batchinfer.ops.startup import StartupError
    from batchinfer.store.registry import (
        NameConflict,  # a live worker holds the name (or an alias)
        PartitionsMismatch,  # BATCHINFER_PARTITIONS is not the deployment's
    )

    try:
        code = main(*args, **kwargs)
    except (StartupError, NameConflict, PartitionsMismatch) as e:
        log.debug("start-up failed", exc_info=True)
        fail(EXIT_STARTUP, str(e))
    sys.exit(code or 0)


def parse_lora_modules(pairs: tuple[str, ...] | list[str]) -> dict[str, str]:
    """``--lora NAME=DIR`` pairs as adapter name -> absolute folder; a usage error naming the flag
    for a pair without ``=``, a bad or repeated NAME, or a DIR that is no folder."""
    from pathlib import Path

    from batchinfer.workers.lora_request import check_adapter_name

    modules: dict[str, str] = {}
    for pair in pairs:
        name, sep, folder = pair.partition("=")
        if not sep or not folder:
            raise click.BadParameter(f"{pair!r}: use NAME=DIR (a PEFT adapter folder), e.g. "
                                     "sql=./adapters/sql", param_hint="--lora")
        try:
            check_adapter_name(name, repr(pair))
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--lora") from None
        if name in modules:
            raise click.BadParameter(f"adapter {name!r} is given twice", param_hint="--lora")
        path = Path(folder).expanduser()
        if not path.is_dir():
            raise click.BadParameter(f"{pair!r}: {folder!r} is not a folder (a PEFT adapter folder: "
                                     "adapter_config.json, adapter_model.safetensors)", param_hint="--lora")
        modules[name] = str(path.resolve())
    return modules


def lora_options(modules: dict[str, str], max_loras: int | None, max_cpu_loras: int | None,
                 max_lora_rank: int | None, echo: bool) -> dict[str, Any]:
    """The engine settings of the LoRA flags: ``EngineConfig``'s, or the echo engine's (the adapter
    names, and ``max_loras`` as the size of its resident LRU; the other two are usage errors)."""
    if echo:
        if max_cpu_loras is not None or max_lora_rank is not None:
            raise click.UsageError("--max-cpu-loras and --max-lora-rank are engine settings: the echo "
                                   "engine has none (it serves --lora names without reading the folders)")
        options: dict[str, Any] = {"adapters": sorted(modules)} if modules else {}
    else:
        options = {"lora_modules": modules} if modules else {}
        if max_cpu_loras is not None:
            options["max_cpu_loras"] = max_cpu_loras
        if max_lora_rank is not None:
            options["max_lora_rank"] = max_lora_rank
    if max_loras is not None:
        options["max_loras"] = max_loras
    return options


def speculative_options(value: str | None, model: str | None = None) -> dict[str, Any]:
    """The engine setting of ``--speculative-config JSON`` (vLLM's flag) and ``--speculative-model
    DIR`` (the draft model: method "draft" unless the JSON names another, which is refused):
    ``{"speculative_config": {...}}`` once ``SpeculativeConfig`` accepts it, ``{}`` without either;
    a usage error naming the flag for text that is not JSON or a config that is wrong."""
    if value is None and model is None:
        return {}
    from batchinfer.workers.speculative_config import SpeculativeConfig

    hint = "--speculative-config" if model is None else "--speculative-config / --speculative-model"
    try:
        config = SpeculativeConfig.from_value(value if value is not None else "{}")
        assert config is not None  # a string never gives None
        if model is not None:
            config = SpeculativeConfig.from_value({**config.to_dict(), "model": model})
            assert config is not None
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint=hint) from None
    return {"speculative_config": config.to_dict()}


SPECULATIVE_HELP = ("Speculative decoding, as vLLM's flag: a JSON object such as '{\"method\": \"ngram\", "
                    "\"num_speculative_tokens\": 4}' (methods ngram, suffix, draft with \"model\": DIR); "
                    "outputs are unchanged [off].")


def lora_flags(func: Callable[..., Any]) -> Callable[..., Any]:
    """The LoRA flags of ``worker`` and ``run``: ``--lora`` (repeatable), ``--max-loras``,
    ``--max-cpu-loras``, ``--max-lora-rank``."""
    for option in reversed([
        click.option("--lora", "lora", multiple=True, metavar="NAME=DIR",
                     help="Serve the PEFT LoRA adapter in folder DIR as NAME, repeatable: requests name it "
                          "as model NAME or BASE:NAME (BASE: the served model name)."),
        click.option("--max-loras", type=POSITIVE,
                     help="Adapters in the forward's weights at once (GPU slots) [4]."),
        click.option("--max-cpu-loras", type=POSITIVE,
                     help="Adapters kept loaded in host memory (at least --max-loras) [every served one]."),
        click.option("--max-lora-rank", type=POSITIVE,
                     help="Largest adapter rank served (sizes the stacked weights) [the largest --lora's]."),
    ]):
        func = option(func)
    return func


def metrics_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """``--metrics-port`` and ``--metrics-host`` of every daemon (its /metrics, /healthz, /readyz)."""
    func = click.option("--metrics-host", metavar="ADDRESS",
                        help="Address the metrics server listens on [127.0.0.1, BATCHINFER_METRICS_HOST]; "
                             "0.0.0.0 for every interface (the endpoints have no authentication).")(func)
    return click.option("--metrics-port", type=PORT,
                        help="Serve /metrics, /healthz, /readyz on this port.")(func)


def override_settings(settings: Settings, **values: Any) -> None:
    """Set the options the command line gave (not None) on ``settings``, over the environment's."""
    for key, value in values.items():
        if value is not None:
            setattr(settings, key, value)


@click.command()
@global_options
@click.option("--lease-seconds", type=SECONDS, help="Re-dispatch a batch not refreshed for this long [60].")
@click.option("--max-attempts", type=POSITIVE, help="Worker crashes a request survives [3].")
@metrics_options
@click.option("--max-line-bytes", type=POSITIVE,
              help="Refuse request bodies longer than this [10 MiB, BATCHINFER_MAX_LINE_BYTES].")
@click.option("--max-tokens-limit", type=POSITIVE,
              help="Refuse requests asking for more max_tokens [1000000, BATCHINFER_MAX_TOKENS_LIMIT].")
@click.option("--max-prompt-tokens", type=POSITIVE,
              help="Refuse prompts longer than this [1000000, BATCHINFER_MAX_PROMPT_TOKENS].")
@click.option("--structured-max-spec-bytes", type=POSITIVE,
              help="Refuse output schemas / regexes / grammars larger than this [65536, "
                   "BATCHINFER_STRUCTURED_MAX_SPEC_BYTES].")
@click.option("--structured-max-depth", type=POSITIVE,
              help="Refuse JSON schemas nested deeper than this [32, BATCHINFER_STRUCTURED_MAX_DEPTH].")
@click.option("--structured-max-choices", type=POSITIVE,
              help="Refuse choice lists longer than this [1024, BATCHINFER_STRUCTURED_MAX_CHOICES].")
@click.option("--structured-compile-timeout", "structured_compile_timeout_s", type=SECONDS,
              help="Refuse specs that take longer to compile [5 s, BATCHINFER_STRUCTURED_COMPILE_TIMEOUT_S].")
@click.pass_obj
def scheduler(ctx: Ctx, lease_seconds: float | None, max_attempts: int | None, metrics_port: int | None,
              metrics_host: str | None, max_line_bytes: int | None, max_tokens_limit: int | None,
              max_prompt_tokens: int | None, structured_max_spec_bytes: int | None,
              structured_max_depth: int | None, structured_max_choices: int | None,
              structured_compile_timeout_s: float | None) -> None:
    """Run the scheduler daemon: intake -> validate -> tokenize -> pack -> dispatch."""
    from batchinfer.scheduler.daemon import main

    override_settings(ctx.settings, lease_seconds=lease_seconds, max_attempts=max_attempts,
                      metrics_port=metrics_port, metrics_host=metrics_host, max_line_bytes=max_line_bytes,
                      max_tokens_limit=max_tokens_limit, max_prompt_tokens=max_prompt_tokens,
                      structured_max_spec_bytes=structured_max_spec_bytes,
                      structured_max_depth=structured_max_depth,
                      structured_max_choices=structured_max_choices,
                      structured_compile_timeout_s=structured_compile_timeout_s)
    run_daemon(main, ctx.settings)


def worker_model(model: str, served_model_names: tuple[str, ...],
                 model_name: str | None) -> tuple[str, tuple[str, ...]]:
    """``--model``'s checkpoint, and the served names: a model named ``demo``, ``tiny`` or ``minilm``
    is served under that name unless ``--served-model-name`` / ``--model-name`` say otherwise (as
    ``run`` does); a path keeps its default (the folder's name, the .gguf file's stem)."""
    from pathlib import Path

    if Path(model).exists():  # a local path wins over the names; resolving it would load torch
        return model, served_model_names
    from batchinfer.workers.models.demo import resolve_model

    try:
        path, name = resolve_model(model)
    except (ValueError, FileNotFoundError) as e:  # not a path nor a name, or a demo package missing
        raise click.BadParameter(str(e), param_hint="--model") from None
    return str(path), served_model_names or (() if model_name else (name,))


@click.command()
@global_options
@click.option("--model", "model_dir", metavar="DIR|FILE.gguf|NAME",
              help="Hugging Face model folder, .gguf file, or demo, tiny, minilm (served under that name, "
                   "as `run` does); optional with --echo.")
@click.option("--name", help="Worker name [host-model-device].")
@click.option("--served-model-name", "served_model_names", multiple=True, metavar="NAME",
              help="Model name to serve, repeatable: the first is the name the worker registers under, "
                   "the others aliases (as vLLM's flag) [the model folder's name].")
@click.option("--model-name", help="One served model name (the first --served-model-name wins).")
@click.option("--device", default=None,
              help="cpu or cuda:N; with --tensor-parallel-size N: cpu (N gloo processes), cuda (cuda:0 .. "
                   "cuda:N-1) or a list cuda:0,cuda:1,... [cuda:0 (cuda) when CUDA is available, else cpu].")
@click.option("--tensor-parallel-size", "tensor_parallel_size", type=POSITIVE, default=None,
              help="Split the model over N ranks (processes), one device each [1].")
@click.option("--echo", is_flag=True, help="Echo engine: answers without a model (tests, benchmarks).")
@click.option("--echo-class", "echo_class", metavar="MODULE:CLASS",
              help="With --echo: serve this subclass of EchoEngine instead (a test double that "
                   "injects faults, say); MODULE must be importable.")
@metrics_options
@click.option("--engine-option", "engine_option", multiple=True, metavar="KEY=VALUE",
              help="Engine (or echo engine) setting, repeatable; VALUE is JSON or a string, e.g. "
                   "max_num_seqs=8, or step_delay=0.05 with --echo.")
@click.option("--structured-outputs-backend", type=click.Choice(["llguidance", "xgrammar"]),
              help="Grammar library that constrains structured outputs [llguidance].")
@click.option("--no-jump-forward", is_flag=True,
              help="Sample every token a grammar forces instead of appending it without a step.")
@click.option("--tool-call-parser", type=click.Choice(TOOL_PARSERS),
              help="Format the model writes tool calls in, read for tool_choice 'auto' "
                   "[the chat template's, when it makes one unambiguous].")
@click.option("--speculative-config", "speculative_config", metavar="JSON", help=SPECULATIVE_HELP)
@click.option("--speculative-model", "speculative_model", metavar="DIR",
              help="Draft model folder for speculative decoding (same tokenizer as --model): method "
                   "\"draft\", with --speculative-config's other settings.")
@quantization_option
@lora_flags
@click.pass_obj
def worker(ctx: Ctx, model_dir: str | None, name: str | None, served_model_names: tuple[str, ...],
           model_name: str | None, device: str | None, echo: bool, echo_class: str | None,
           metrics_port: int | None, metrics_host: str | None,
           engine_option: tuple[str, ...], structured_outputs_backend: str | None,
           no_jump_forward: bool, tool_call_parser: str | None, tensor_parallel_size: int | None,
           lora: tuple[str, ...], max_loras: int | None, max_cpu_loras: int | None,
           max_lora_rank: int | None, speculative_config: str | None,
           speculative_model: str | None, quantization: str | None) -> None:
    """Run a worker daemon: pull batches, run the engine, publish results.

    With ``--lora NAME=DIR`` it also serves each adapter, as model ``BASE:NAME`` (aliases ``NAME``
    and ``ALIAS:NAME``), reading one batch stream per adapter."""
    from batchinfer.workers.service.serve import main, parse_engine_options

    if not model_dir and not echo:
        raise click.UsageError("--model DIR|FILE.gguf|NAME is required (or --echo)")
    if model_dir:
        model_dir, served_model_names = worker_model(model_dir, served_model_names, model_name)
    if echo and (structured_outputs_backend or no_jump_forward):
        raise click.UsageError("--structured-outputs-backend and --no-jump-forward are engine settings: "
                               "the echo engine has none")
    if echo and (speculative_config is not None or speculative_model is not None):
        raise click.UsageError("--speculative-config and --speculative-model are engine settings: "
                               "the echo engine has none")
    if echo and quantization:
        raise click.UsageError("--quantization is an engine setting: the echo engine has none")
    if echo_class and not echo:
        raise click.UsageError("--echo-class names the echo engine's class: give --echo too")
    if echo and tensor_parallel_size:
        raise click.UsageError("--tensor-parallel-size is an engine setting: the echo engine has none")
    override_settings(ctx.settings, metrics_port=metrics_port, metrics_host=metrics_host)
    # The echo engine needs no device: skip importing torch (about 200 MB per echo worker).
    if device is None and not echo and (tensor_parallel_size or 1) > 1:
        device = "cuda" if default_device() != "cpu" else "cpu"  # cuda: one GPU per rank, from cuda:0
    device = device or ("cpu" if echo else default_device())
    try:
        options = parse_engine_options(engine_option)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--engine-option") from None
    if structured_outputs_backend:  # EngineConfig fields, as --engine-option would set them
        options["structured_outputs_backend"] = structured_outputs_backend
    if no_jump_forward:
        options["jump_forward"] = False
    if tensor_parallel_size:
        options["tensor_parallel_size"] = tensor_parallel_size
    if quantization:
        options["quantization"] = quantization
    options.update(speculative_options(speculative_config, speculative_model))
    options.update(lora_options(parse_lora_modules(lora), max_loras, max_cpu_loras, max_lora_rank, echo))
    run_daemon(main, ctx.settings, model_dir, name, device, echo, model_name=model_name,
               served_model_names=served_model_names, engine_options=options, echo_class=echo_class,
               tool_call_parser=tool_call_parser)


@click.command()
@global_options
@click.option("--name", help="rq worker name [exporter-host-pid].")
@click.option("--burst", is_flag=True, help="Exit when the queue is empty.")
@metrics_options
@click.pass_obj
def exporter(ctx: Ctx, name: str | None, burst: bool, metrics_port: int | None,
             metrics_host: str | None) -> None:
    """Run the exporter: an rq worker (JSON serializer) writing result files."""
    from batchinfer.jobs.exporter import main

    override_settings(ctx.settings, metrics_port=metrics_port, metrics_host=metrics_host)
    run_daemon(main, ctx.settings, name=name, burst=burst)
