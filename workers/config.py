"""``EngineConfig`` (what sizes and shapes one engine) and ``WorkerConfig`` (how a worker daemon
presents itself: its name and served model names), each validated in one place.

Every error is a ``ValueError`` whose message starts with the field's name. torch is imported
only where an engine setting needs it: an echo worker builds a ``WorkerConfig`` without it.
"""

from __future__ import annotations

import os
import socket
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from batchinfer.workers.structured.params import StructuredLimits

if TYPE_CHECKING:
    import torch

DTYPE_NAMES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16", "float16": "float16",
               "half": "float16"}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"`` / ``torch.bfloat16`` -> ``torch.bfloat16``; anything else is a ValueError."""
    import torch

    dtypes = {name: getattr(torch, canonical) for name, canonical in DTYPE_NAMES.items()}
    if isinstance(dtype, torch.dtype):
        if dtype in dtypes.values():
            return dtype
    elif isinstance(dtype, str) and dtype in dtypes:
        return dtypes[dtype]
    raise ValueError(f"dtype must be one of {sorted(dtypes)}, got {dtype!r}")


def _positive_int(name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass
class EngineConfig:
    """How one engine is built: the model, the KV cache size and the step budget."""

    model: str  # a Hugging Face model directory
    dtype: str | torch.dtype = "float32"
    device: str = "cpu"
    block_size: int = 16  # tokens per KV block
    # KV cache capacity, first that is set wins: an explicit block count, a byte budget, or (on
    # CUDA) this fraction of the device memory minus what a profiling forward pass used.
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int = 2048  # tokens per step (prefill chunks + decodes)
    max_num_seqs: int = 256  # sequences per step
    enable_prefix_caching: bool = True
    max_model_len: int | None = None  # None: the model's max positions, capped by the KV pool
    attention_backend: str | None = None  # kernels backend; None: best for the device
    seed: int = 0  # seeds the generator of requests that set no seed
    enforce_eager: bool = False  # no CUDA graphs
    # Structured outputs (batchinfer.workers.structured): the grammar library, whether forced
    # tokens are appended without a sampling step each, the compiled-grammar LRU's size, the mask
    # fill's threads (None: the backend's default) and the limits on one spec.
    structured_outputs_backend: str = "llguidance"
    jump_forward: bool = True
    grammar_cache_size: int = 256
    grammar_threads: int | None = None
    structured_limits: StructuredLimits = field(default_factory=StructuredLimits)

    def __post_init__(self) -> None:
        import torch

        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a model directory path, got {self.model!r}")
        self.dtype = resolve_dtype(self.dtype)
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError):
            raise ValueError("device must be a torch device such as 'cpu' or 'cuda:0', "
                             f"got {self.device!r}") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} asked for but CUDA is not available")
        self.device = str(device)
        _positive_int("block_size", self.block_size)
        _positive_int("num_kv_blocks", self.num_kv_blocks, allow_none=True)
        _positive_int("kv_cache_memory", self.kv_cache_memory, allow_none=True)
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {u!r}")
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("max_model_len", self.max_model_len, allow_none=True)
        from batchinfer.workers.structured.backend import BACKENDS

        if self.structured_outputs_backend not in BACKENDS:
            raise ValueError(f"structured_outputs_backend must be one of {', '.join(BACKENDS)}, "
                             f"got {self.structured_outputs_backend!r}")
        _positive_int("grammar_cache_size", self.grammar_cache_size)
        _positive_int("grammar_threads", self.grammar_threads, allow_none=True)
        if isinstance(self.structured_limits, dict):
            self.structured_limits = StructuredLimits(**self.structured_limits)
        if not isinstance(self.structured_limits, StructuredLimits):
            raise ValueError(f"structured_limits must be StructuredLimits, got {self.structured_limits!r}")
        for name in ("enable_prefix_caching", "enforce_eager", "jump_forward"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.attention_backend is not None and not isinstance(self.attention_backend, str):
            raise ValueError("attention_backend must be a backend name or None, "
                             f"got {self.attention_backend!r}")

    @property
    def torch_device(self) -> torch.device:
        import torch

        return torch.device(self.device)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (dtype as its name)."""
        d = asdict(self)
        d["dtype"] = str(self.dtype).removeprefix("torch.")
        return d


def _served_name(what: str, value: Any) -> str:
    if not isinstance(value, str) or not value or any(c.isspace() for c in value):
        raise ValueError(f"{what} must be a non-empty name without spaces, got {value!r}")
    return value


@dataclass
class WorkerConfig:
    """How one worker daemon presents itself: its name and the model names it serves.

    ``served_model_names`` are vLLM's ``--served-model-name``: the first is the canonical name
    (the worker registers under it and pulls ``{p}:batches:<canonical>``), the others are aliases
    a request's ``model`` may name as well. Empty: ``[model_name]`` when that is given (the single
    ``--model-name`` of earlier versions), else ``[model]``, the model folder's (the engine's)
    name. ``name`` defaults to ``<host>-<canonical>-<device>-<pid>``: unique per process on a host,
    and stable across restarts of a container (same hostname, same pid 1).
    """

    model: str  # the engine's model name: the model folder's name (``echo`` for a bare echo engine)
    served_model_names: list[str] = field(default_factory=list)
    model_name: str | None = None
    name: str | None = None
    device: str = "cpu"

    def __post_init__(self) -> None:
        if isinstance(self.served_model_names, str):  # one name passed bare: not a list of letters
            self.served_model_names = [self.served_model_names]
        names = [_served_name("served_model_names", n) for n in self.served_model_names]
        if self.model_name is not None:
            _served_name("model_name", self.model_name)
            if names and names[0] != self.model_name:
                raise ValueError(f"model_name {self.model_name!r} and served_model_names {names} disagree: "
                                 "give the names once, as served_model_names (the first is canonical)")
        if not names:
            names = [self.model_name or _served_name("model", self.model)]
        self.served_model_names = list(dict.fromkeys(names))  # a name given twice is served once
        if self.name is None:
            device = self.device.replace(":", "")
            self.name = f"{socket.gethostname()}-{self.canonical}-{device}-{os.getpid()}"
        _served_name("name", self.name)

    @property
    def canonical(self) -> str:
        """The name the worker registers its model under."""
        return self.served_model_names[0]

    @property
    def aliases(self) -> list[str]:
        """The other served names: requests naming them go to the canonical model's batches."""
        return self.served_model_names[1:]
