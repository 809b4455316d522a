"""``batchinfer worker``: build the engine, serve until SIGTERM.

The process around :class:`~batchinfer.workers.service.daemon.WorkerDaemon`: the engine (``Engine``;
``EmbeddingEngine`` for an embedding model; or the echo engine) from the command line's options,
the Redis connection, the signal handlers that turn SIGTERM / SIGINT into the loop's drain and
hard-stop events, and the ``/metrics`` server.
"""

from __future__ import annotations

import gc
import importlib
import json
import logging
import signal
import threading
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from batchinfer.config import Settings
from batchinfer.ops.httpserver import Readiness
from batchinfer.ops.httpserver import serve as serve_http
from batchinfer.ops.metrics import WorkerMetrics
from batchinfer.ops.startup import StartupError
from batchinfer.workers.engine.interface import WorkerEngine
from batchinfer.workers.engine.tp_ranks import RankFailure
from batchinfer.workers.service.daemon import WorkerDaemon
from batchinfer.workers.text.tokenizer_files import read_tokenizer_files

if TYPE_CHECKING:
    from batchinfer.workers.service.echo_engine import EchoEngine

log = logging.getLogger(__name__)
# How the engine's errors about adapters and the LoRA settings begin (workers.lora.adapter, EngineConfig)
LORA_SETTINGS = ("lora", "max_loras", "max_cpu_loras", "max_lora_rank")


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


def freeze_heap() -> None:
    """Take everything allocated so far (torch, the model, the tokenizer: a few hundred thousand
    objects) out of the garbage collector's full collections, which otherwise walk them all: a pause
    of 0.15-0.26 s on the engine thread about once per 1,024-request job of the tiny model on CPU
    (docs/benchmarks.md, "Queue"). What the worker allocates later is collected as before."""
    gc.collect()
    gc.freeze()


def check_device(device: str) -> None:
    """``StartupError`` (with what to do) for a device this machine cannot run on; cheap for ``cpu``.

    A comma list (tensor parallelism: ``cuda:0,cuda:1``) is checked device by device."""
    if device == "cpu":
        return
    if "," in device:
        for one in device.split(","):
            check_device(one.strip())
        return
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise StartupError(f"--device {device!r} is not a device: use --device cpu or cuda:N") from None
    if dev.type != "cuda":
        raise StartupError(f"--device {device!r}: only cpu and cuda:N are supported")
    if not torch.cuda.is_available():
        build = "a CPU-only build of torch" if torch.version.cuda is None else f"torch {torch.__version__}"
        raise StartupError(f"--device {device}: CUDA is not available on this machine ({build}); use "
                           "--device cpu, or check the NVIDIA driver and CUDA_VISIBLE_DEVICES "
                           f"(`batchinfer doctor --device {device}`)")
    count = torch.cuda.device_count()
    if (dev.index or 0) >= count:
        raise StartupError(f"--device {device}: this machine has {count} CUDA device(s), "
                           f"cuda:0 to cuda:{count - 1}; check CUDA_VISIBLE_DEVICES")


def echo_engine_class(path: str | None) -> type[EchoEngine]:
    """``EchoEngine``, or the subclass ``MODULE:CLASS`` names (``--echo-class``)."""
    from batchinfer.workers.service.echo_engine import EchoEngine

    if path is None:
        return EchoEngine
    module_name, sep, class_name = path.partition(":")
    if not sep or not module_name or not class_name:
        raise StartupError(f"--echo-class {path!r}: give MODULE:CLASS")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as e:
        raise StartupError(f"--echo-class {path!r}: {type(e).__name__}: {e}") from e
    if not (isinstance(cls, type) and issubclass(cls, EchoEngine)):
        raise StartupError(f"--echo-class {path!r} is not a subclass of EchoEngine")
    return cls


def build_engine(model_dir: str | None, device: str, echo: bool, options: dict[str, Any],
                 echo_class: str | None = None) -> WorkerEngine:
    """The engine (or the echo engine) for ``model_dir``; ``StartupError`` saying what to fix."""
    if not echo and not model_dir:
        raise StartupError("--model: a model folder is required (or --echo)")
    doctor = f"`batchinfer doctor --model {model_dir}` checks the folder" if model_dir else ""
    try:
        if echo:
            cls = echo_engine_class(echo_class)
            return cls.from_model_dir(model_dir, **options) if model_dir else cls(**options)
        check_device(device)
        from batchinfer.workers.engine_config import EngineConfig

        config = EngineConfig(model=str(model_dir), device=device, **options)
        # an embedding checkpoint (an encoder, or a decoder with sentence-transformers pooling files)
        # is served as any other model: the worker registers its task and the scheduler routes by it
        from batchinfer.workers.engine.embedder import engine_for

        engine = engine_for(config)
        # once built (a model that fails to load says only why), in the dtype it runs in: dtype auto's
        # pick, or bfloat16 under int8 / int4 (then the quantization a generation engine applied)
        plan = getattr(engine, "quantization", None)  # a generation engine's QuantPlan
        model = getattr(engine, "model", None)
        dtype = str(getattr(model, "dtype", config.dtype)).removeprefix("torch.")
        quantized = (f", weights quantized (quantization {config.quantization}): layers {plan.layers}, "
                     f"LM head {plan.head}") if plan is not None and plan.active else ""
        log.info("engine: %s on %s in %s%s%s", model_dir, config.device, dtype,
                 " (dtype auto)" if options.get("dtype") == "auto" else "", quantized)
    except TypeError as e:  # an engine option the engine does not have
        raise StartupError(f"--engine-option {sorted(options)}: {e}") from e
    except FileNotFoundError as e:
        raise StartupError(f"{e}: --model needs a Hugging Face model folder (config.json, *.safetensors, "
                           f"tokenizer.json); {doctor}") from e
    except ValueError as e:  # an unsupported architecture, a bad config or option value
        if str(e).startswith(LORA_SETTINGS):  # an adapter folder or a LoRA flag, not the model
            raise StartupError(f"{e}; check --lora NAME=DIR (a PEFT adapter folder) and --max-loras, "
                               "--max-cpu-loras, --max-lora-rank") from e
        raise StartupError(f"{e}; {doctor or 'check --engine-option'}") from e
    except RankFailure as e:  # a tensor-parallel rank could not start (its error, or its death)
        raise StartupError(f"--tensor-parallel-size: {e}") from e
    if device == "cpu" and engine.task == "generate":  # an encoder's attention takes no compiled op
        prepare_cpu_kernels()
    return engine


def prepare_cpu_kernels() -> None:
    """Build (or load) the compiled CPU kernels before the worker registers, not in its engine's
    first step: on a fresh machine, or after their sources changed, the build takes minutes, and a
    worker that registered and then sat in it let its registration lapse (its keeper's stall guard),
    so ``batchinfer run`` said that no live worker served the model; unregistered, a worker reads as
    loading it. ``BATCHINFER_CPU_DECODE_KERNEL=0``: nothing to build; ``1`` with a failed build:
    ``StartupError`` with the compiler's reason (``auto`` serves on the torch paths after the
    build's warning)."""
    from batchinfer.kernels.cpu_ext import decode

    try:
        mode = decode.kernel_mode()
    except ValueError as e:
        raise StartupError(str(e)) from e
    if mode == "0":
        return
    if decode.library() is None and mode == "1":
        raise StartupError(f"{decode.ENV}=1 but the CPU kernels did not build: {decode.unavailable_reason()}")


def main(settings: Settings, model_dir: str | None, name: str | None = None, device: str = "cpu",
         echo: bool = False, *, model_name: str | None = None, served_model_names: Sequence[str] = (),
         engine_options: dict[str, Any] | None = None, echo_class: str | None = None,
         tool_call_parser: str | None = None) -> int:
    """``batchinfer worker``: build the engine (or the echo engine), then serve until SIGTERM.

    ``served_model_names`` (``--served-model-name``, repeatable): the first is the name the worker
    registers under, the others aliases; without it ``model_name`` or the model folder's name.
    ``tool_call_parser`` (``--tool-call-parser``): the format of ``auto`` tool calls [the chat
    template's, when it makes one unambiguous].
    What the operator must fix first raises :class:`~batchinfer.ops.startup.StartupError`.
    """

    options = dict(engine_options or {})
    if not echo:  # the scheduler's structured-output limits, so that what it accepts runs here
        from batchinfer.workers.structured_params import limits_from_settings

        try:
            options["structured_limits"] = limits_from_settings(settings, options.get("structured_limits"))
        except (ValueError, TypeError) as e:
            raise StartupError(f"structured-output limits (BATCHINFER_STRUCTURED_*, --engine-option "
                               f"structured_limits): {e}") from e
    engine = build_engine(model_dir, device, echo, options, echo_class)
    files = read_tokenizer_files(model_dir) if model_dir else engine.tokenizer_files()
    from batchinfer.workers.service.worker_config import WorkerConfig

    try:  # the names the worker serves and its own: refused now, before anything registers
        config = WorkerConfig(model=engine.model_name, served_model_names=list(served_model_names),
                              model_name=model_name, name=name, device=device,
                              tool_call_parser=tool_call_parser)
    except ValueError as e:
        raise StartupError(f"{e} (--served-model-name, --model-name, --name, --tool-call-parser)") from e
    assert config.name is not None  # WorkerConfig fills in the default
    name, model = config.name, config.canonical
    stop, hard = threading.Event(), threading.Event()

    def on_signal(signum, frame):
        if stop.is_set():
            hard.set()
        stop.set()
        log.info("worker %s: %s received; %s", name, signal.Signals(signum).name,
                 "stopping now" if hard.is_set() else "draining (again to stop at once)")

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    r = settings.connect()
    metrics = WorkerMetrics(model, worker=name, device=device)
    readiness = Readiness(stall_after=10 * settings.lease_seconds)
    readiness.mark("serving", False, "registering")
    readiness.add_probe("redis", r.ping)
    daemon = WorkerDaemon(r, settings, engine, config, tokenizer_files=files, hard_stop=hard, metrics=metrics,
                          readiness=readiness)
    server = serve_http(settings.metrics_port, metrics.registry, readiness, settings.metrics_host)
    freeze_heap()  # the engine is built: what exists now lives as long as the process
    # OMP_WAIT_POLICY=PASSIVE is deliberately not set for the worker: set before torch loaded, it
    # made bench/queue_bench.py's unpinned overhead ratio 0.59-0.60 against 0.81-0.84 without it
    # (two pairs, 2026-12-05; docs/benchmarks.md, "Queue").
    try:
        return daemon.run(stop)
    finally:
        if server is not None:
            server.stop()
        close = getattr(engine, "close", None)  # a tensor-parallel engine: shut its rank processes down
        if close is not None:
            close()
