"""``dtype="auto"``: the fast dtype for the engine's device (and, on CUDA, the checkpoint).

- CPU: bfloat16 when the CPU multiplies bfloat16 natively (x86 ``avx512_bf16`` or AMX ``amx_bf16``:
  about twice float32's matmul speed), else float32 (emulated bfloat16 is slower than float32).
- CUDA: the checkpoint's ``torch_dtype`` when it is bfloat16 or float16, else bfloat16 where the GPU
  has it (compute capability 8.0+), else float16. A bfloat16 checkpoint on a GPU without bfloat16
  runs in float16.
- A GGUF file names no torch dtype: the same rules with no checkpoint dtype.

``EngineConfig`` resolves ``"auto"`` through :func:`auto_dtype` once, when it is built, so that
``config.dtype``, ``config.model_load`` and ``config.to_dict()`` all name the dtype that runs.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch

CPU_BF16_ENV = "BATCHINFER_CPU_BF16"  # "1" / "0": overrides cpu_has_bf16()'s probe
_HALF = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_has_bf16() -> bool:
    """Whether this CPU runs bfloat16 matmuls natively: x86 ``avx512_bf16`` or ``amx_bf16``.

    ``BATCHINFER_CPU_BF16=1`` / ``=0`` overrides the probe (tests; an operator who measured
    otherwise). The probe asks torch's cpuinfo (any OS), else Linux's ``/proc/cpuinfo`` flags.
    Other CPUs (aarch64 included) answer False: float32.
    """
    forced = os.environ.get(CPU_BF16_ENV)
    if forced is not None:
        if forced not in ("0", "1"):
            raise ValueError(f"{CPU_BF16_ENV} must be 0 or 1, got {forced!r}")
        return forced == "1"
    return _probe_cpu_bf16()


@functools.cache
def _probe_cpu_bf16() -> bool:
    try:  # cpuinfo's flags, as torch's kernel dispatch reads them (private: may move)
        caps = torch._C._cpu._get_cpu_capability()
        if "avx512_bf16" in caps:
            return bool(caps["avx512_bf16"] or caps.get("amx_bf16"))
    except (AttributeError, RuntimeError):
        pass
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux's ``/proc/cpuinfo`` lists them (empty where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return frozenset()
    lines = (line.split(":", 1)[-1] for line in text.splitlines() if line.startswith("flags"))
    return frozenset(flag for line in lines for flag in line.split())


def checkpoint_dtype(model: str) -> str | None:
    """The ``torch_dtype`` (transformers 5: ``dtype``) a Hugging Face folder's config.json names;
    None for a GGUF file or a folder without a readable config.json."""
    path = Path(model) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    name = (config.get("torch_dtype") or config.get("dtype")) if isinstance(config, dict) else None
    return str(name).removeprefix("torch.") if name else None


def auto_dtype(device: torch.device, model: str) -> torch.dtype:
    """What ``dtype="auto"`` runs ``model`` in on ``device`` (the rules in the module docstring)."""
    if device.type != "cuda":
        return torch.bfloat16 if cpu_has_bf16() else torch.float32
    has_bf16 = torch.cuda.get_device_capability(device)[0] >= 8
    stored = _HALF.get(checkpoint_dtype(model) or "")
    if stored is torch.float16 or (stored is torch.bfloat16 and not has_bf16):
        return torch.float16
    return torch.bfloat16 if has_bf16 else torch.float16
