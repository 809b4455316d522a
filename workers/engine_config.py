"""``EngineConfig``: what sizes and shapes one engine, validated in one place.

Built flat (``EngineConfig(model=..., max_num_seqs=...)``, as ``LLM(**kwargs)``, the CLI's
``--engine-option`` and vLLM's EngineArgs pass it) and read by part: ``config.model_load``,
``.cache``, ``.scheduler``, ``.parallel``, ``.lora`` and ``.structured`` are frozen views of the
flat fields, one per component, so that each component is handed only what it reads.

Every error is a ``ValueError`` whose message starts with the field's name. torch is imported
only where a setting needs it (the dtype, the devices).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from batchinfer.workers.quantization_config import check_quantization
from batchinfer.workers.speculative_config import SpeculativeConfig
from batchinfer.workers.structured_params import BACKENDS, StructuredLimits

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
    raise ValueError(f"dtype must be 'auto' or one of {sorted(dtypes)}, got {dtype!r}")


def _one_device(name: str) -> torch.device:
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError("device must be a torch device such as 'cpu' or 'cuda:0', "
                         f"got {name!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for but CUDA is not available")
    return device


def rank_devices(device: str, size: int) -> list[torch.device]:
    """The devices of ``size`` tensor-parallel ranks: ``"cpu"`` -> every rank on the CPU,
    ``"cuda"`` -> cuda:0 .. cuda:size-1, ``"cuda:0,cuda:2"`` -> one per rank (exactly ``size``,
    distinct). ValueError naming ``device`` when the list is wrong or the machine has too few GPUs.
    """
    import torch

    if not isinstance(device, str) or not device.strip():
        raise ValueError(f"device must be a device name or a comma list of them, got {device!r}")
    names = [n.strip() for n in device.split(",")]
    if size == 1 or (len(names) == 1 and names[0] in ("cpu", "cuda")):
        one = _one_device(names[0])
        if size == 1 and len(names) > 1:
            raise ValueError(f"device {device!r} lists {len(names)} devices but tensor_parallel_size is 1")
        if one.type == "cpu":
            return [one] * size
        if size == 1:
            return [one]
        names = [f"cuda:{i}" for i in range(size)]
    devices = [_one_device(n) for n in names]
    if len(devices) != size:
        raise ValueError(f"device {device!r} lists {len(devices)} device(s) for tensor_parallel_size {size}: "
                         f"give one per rank, or 'cuda' for cuda:0..cuda:{size - 1}, or 'cpu'")
    if any(d.type != "cuda" for d in devices):
        raise ValueError(f"device {device!r}: a tensor-parallel device list holds CUDA devices only "
                         "(use 'cpu' alone for every rank on the CPU)")
    indices = [d.index if d.index is not None else 0 for d in devices]
    if len(set(indices)) != len(indices):
        raise ValueError(f"device {device!r} names a device twice: each rank needs its own GPU")
    count = torch.cuda.device_count()
    if max(indices) >= count:
        raise ValueError(f"device {device!r}: tensor_parallel_size {size} needs {size} GPUs but this machine "
                         f"has {count} (cuda:0 to cuda:{count - 1}); check CUDA_VISIBLE_DEVICES")
    return [torch.device("cuda", i) for i in indices]


def _positive_int(name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class ModelLoadConfig:
    """Which model, and how it is loaded and run (``load_model``, the model runner, the sampler's seed)."""

    model: str
    dtype: torch.dtype
    attention_backend: str | None
    enforce_eager: bool
    seed: int
    quantization: str  # none, int8, int4 or auto (batchinfer.workers.quant)


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block size, capacity (see ``EngineConfig``) and prefix caching."""

    block_size: int
    num_kv_blocks: int | None
    kv_cache_memory: int | None
    gpu_memory_utilization: float
    enable_prefix_caching: bool


@dataclass(frozen=True)
class StepSchedulerConfig:
    """The step budget of the ``StepScheduler`` and the longest sequence asked for."""

    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int | None


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism: the rank count, the rendezvous, and each rank's device (rank 0 first)."""

    tensor_parallel_size: int
    tp_port: int | None
    tp_timeout_s: float
    devices: tuple[str, ...]  # one per rank: "cpu" for every rank on the CPU, else "cuda:i"


@dataclass(frozen=True)
class LoRAConfig:
    """The adapters an engine serves (``LoRAManager``)."""

    lora_modules: Mapping[str, str]
    enable_lora: bool
    max_loras: int
    max_cpu_loras: int | None
    max_lora_rank: int | None

    @property
    def enabled(self) -> bool:
        """Whether the engine serves adapters (some given, or ``enable_lora``)."""
        return self.enable_lora or bool(self.lora_modules)


@dataclass(frozen=True)
class StructuredConfig:
    """Structured outputs (``StructuredOutputManager``); the flat fields named in brackets."""

    backend: str  # [structured_outputs_backend]
    jump_forward: bool
    grammar_cache_size: int
    grammar_threads: int | None
    limits: StructuredLimits  # [structured_limits]


@dataclass
class EngineConfig:
    """How one engine is built: the model, the KV cache size and the step budget."""

    model: str  # a Hugging Face model directory
    # "auto": the fast dtype for the device (bfloat16 on CPUs with avx512_bf16 / AMX: see
    # batchinfer.workers.auto_dtype), resolved when the config is built; float32 is the reference.
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
    # Tensor parallelism (batchinfer.workers.parallel): the number of ranks (rank 0 is this
    # process); with N > 1 ``device`` is "cpu" (every rank on the CPU, gloo), "cuda" (cuda:0 ..
    # cuda:N-1, NCCL) or a comma list of N CUDA devices. ``tp_port``: the rendezvous port on
    # 127.0.0.1 (None: a free one); ``tp_timeout_s`` bounds every collective and the start-up.
    tensor_parallel_size: int = 1
    tp_port: int | None = None
    tp_timeout_s: float = 120.0
    # LoRA adapters (batchinfer.workers.lora): the adapters served from the start (name -> PEFT
    # folder), whether more may come with requests (``LoRARequest``; implied by lora_modules),
    # adapters resident in the forward's stacked weights at once, adapters kept on the host
    # (None: every served one, at least max_loras) and the largest rank (None: the largest of
    # lora_modules, 16 when none is given).
    lora_modules: dict[str, str] = field(default_factory=dict)
    enable_lora: bool = False
    max_loras: int = 4
    max_cpu_loras: int | None = None
    max_lora_rank: int | None = None
    # Speculative decoding (batchinfer.workers.spec): the proposer method and its settings, as a
    # SpeculativeConfig, its dict (vLLM's keys) or JSON text; None: its defaults (no method: only a
    # request's own `prediction` drafts). A draft model runs unsharded on rank 0's device.
    speculative_config: SpeculativeConfig | None = None
    # Weight-only quantization of the linear layers on the CPU (batchinfer.workers.quant): "none",
    # "int8", "int4" or "auto" (a GGUF keeps its precision class: Q4_* int4, Q5_* / Q6_K / Q8_0 int8;
    # none for a Hugging Face folder, a GPU or tensor parallelism). int8 / int4 run in bfloat16:
    # dtype float32 (the default) becomes bfloat16 here, float16 is refused; so do a CUDA device
    # and tensor_parallel_size > 1. "auto" is settled, and bfloat16 chosen, when the engine loads.
    quantization: str = "none"

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a model directory path, got {self.model!r}")
        _positive_int("tensor_parallel_size", self.tensor_parallel_size)
        if self.tp_port is not None and (isinstance(self.tp_port, bool) or not isinstance(self.tp_port, int)
                                         or not 0 < self.tp_port < 65536):
            raise ValueError(f"tp_port must be a TCP port in [1, 65535] or None, got {self.tp_port!r}")
        t = self.tp_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise ValueError(f"tp_timeout_s must be a positive number of seconds, got {t!r}")
        if self.tensor_parallel_size > 1:
            self.device = ",".join(str(d) for d in rank_devices(self.device, self.tensor_parallel_size))
            if self.device.startswith("cpu"):
                self.device = "cpu"
        else:
            self.device = str(rank_devices(self.device, 1)[0])
        if isinstance(self.dtype, str) and self.dtype == "auto":  # from here on, the dtype that runs
            from batchinfer.workers.auto_dtype import auto_dtype

            self.dtype = auto_dtype(self.torch_device, self.model)
        self.dtype = resolve_dtype(self.dtype)
        _positive_int("block_size", self.block_size)
        _positive_int("num_kv_blocks", self.num_kv_blocks, allow_none=True)
        _positive_int("kv_cache_memory", self.kv_cache_memory, allow_none=True)
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {u!r}")
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("max_model_len", self.max_model_len, allow_none=True)
        if self.structured_outputs_backend not in BACKENDS:
            raise ValueError(f"structured_outputs_backend must be one of {', '.join(BACKENDS)}, "
                             f"got {self.structured_outputs_backend!r}")
        _positive_int("grammar_cache_size", self.grammar_cache_size)
        _positive_int("grammar_threads", self.grammar_threads, allow_none=True)
        if isinstance(self.structured_limits, dict):
            self.structured_limits = StructuredLimits(**self.structured_limits)
        if not isinstance(self.structured_limits, StructuredLimits):
            raise ValueError(f"structured_limits must be StructuredLimits, got {self.structured_limits!r}")
        self._check_lora()
        self.speculative_config = SpeculativeConfig.from_value(self.speculative_config)
        self.dtype = check_quantization(self.quantization, self.dtype, self.device, self.tensor_parallel_size)
        for name in ("enable_prefix_caching", "enforce_eager", "jump_forward", "enable_lora"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.attention_backend is not None and not isinstance(self.attention_backend, str):
            raise ValueError("attention_backend must be a backend name or None, "
                             f"got {self.attention_backend!r}")

    def _check_lora(self) -> None:
        from batchinfer.workers.lora_request import check_adapter_name

        if not isinstance(self.lora_modules, dict):
            raise ValueError(f"lora_modules must be a dict of adapter name -> folder, "
                             f"got {self.lora_modules!r}")
        for name, path in self.lora_modules.items():
            check_adapter_name(name, "lora_modules")
            if not isinstance(path, str) or not path:
                raise ValueError(f"lora_modules[{name!r}] must be an adapter folder path, got {path!r}")
        _positive_int("max_loras", self.max_loras)
        _positive_int("max_cpu_loras", self.max_cpu_loras, allow_none=True)
        _positive_int("max_lora_rank", self.max_lora_rank, allow_none=True)
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras "
                             f"({self.max_loras})")
        if self.lora_enabled and self.tensor_parallel_size > 1:
            raise ValueError("lora_modules / enable_lora: LoRA adapters are not served with "
                             "tensor_parallel_size > 1 yet; run one worker per device instead")

    @property
    def lora_enabled(self) -> bool:
        """Whether the engine serves adapters (some given, or ``enable_lora``)."""
        return self.lora.enabled

    # -- the parts, each read from the flat fields when asked (so they always agree) ------------

    @property
    def model_load(self) -> ModelLoadConfig:
        return ModelLoadConfig(self.model, resolve_dtype(self.dtype), self.attention_backend,
                               self.enforce_eager, self.seed, self.quantization)

    @property
    def cache(self) -> CacheConfig:
        return CacheConfig(self.block_size, self.num_kv_blocks, self.kv_cache_memory,
                           self.gpu_memory_utilization, self.enable_prefix_caching)

    @property
    def scheduler(self) -> StepSchedulerConfig:
        return StepSchedulerConfig(self.max_num_batched_tokens, self.max_num_seqs, self.max_model_len)

    @property
    def parallel(self) -> ParallelConfig:
        return ParallelConfig(self.tensor_parallel_size, self.tp_port, self.tp_timeout_s,
                              tuple(str(d) for d in self.rank_devices))

    @property
    def lora(self) -> LoRAConfig:
        return LoRAConfig(dict(self.lora_modules), self.enable_lora, self.max_loras, self.max_cpu_loras,
                          self.max_lora_rank)

    @property
    def structured(self) -> StructuredConfig:
        return StructuredConfig(self.structured_outputs_backend, self.jump_forward, self.grammar_cache_size,
                                self.grammar_threads, self.structured_limits)

    @property
    def torch_device(self) -> torch.device:
        """The engine's own device (rank 0's under tensor parallelism)."""
        return self.rank_devices[0]

    @property
    def rank_devices(self) -> list[torch.device]:
        """The device of each tensor-parallel rank, rank 0 first (one entry without TP)."""
        return rank_devices(self.device, self.tensor_parallel_size)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (dtype as its name, speculative_config as its dict)."""
        d = asdict(self)
        d["dtype"] = str(self.dtype).removeprefix("torch.")
        if self.speculative_config is not None:
            d["speculative_config"] = self.speculative_config.to_dict()
        return d
