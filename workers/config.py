"""``EngineConfig``: everything that sizes and shapes one engine, validated in one place.

Every error is a ``ValueError`` whose message starts with the field's name.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"`` / ``torch.bfloat16`` -> ``torch.bfloat16``; anything else is a ValueError."""
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
    elif isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")


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

    def __post_init__(self) -> None:
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
        for name in ("enable_prefix_caching", "enforce_eager"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.attention_backend is not None and not isinstance(self.attention_backend, str):
            raise ValueError("attention_backend must be a backend name or None, "
                             f"got {self.attention_backend!r}")

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (dtype as its name)."""
        d = asdict(self)
        d["dtype"] = str(self.dtype).removeprefix("torch.")
        return d
