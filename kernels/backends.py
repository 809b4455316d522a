"""Which attention backends exist, which one a call gets, and why a backend is refused.

Selection never reads tensor values (no host sync), so it is safe inside CUDA-graph capture:

- ``backend=None``: the best backend available for the tensors' device and shapes —
  ``flash > triton > reference`` on CUDA, ``cpu`` on CPU (``reference`` stays available by name:
  it is the specification).
- an explicit name: that backend, or a ``ValueError`` (unknown name) / ``RuntimeError``
  (known but unavailable here) that names it and says why.

The Triton backend also runs CPU tensors when ``TRITON_INTERPRET=1`` (the Triton interpreter,
used by the tests); without that variable it is CUDA-only.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

BACKENDS = ("flash", "triton", "reference", "cpu")  # every backend name
PREFERENCE = {  # per device type, best first; other devices get "reference" only
    "cuda": ("flash", "triton", "reference"),
    "cpu": ("cpu", "triton", "reference"),  # triton only under the interpreter
}


def triton_interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def triton_unavailable_reason() -> str | None:
    """None when triton imports, else the reason it does not."""
    if importlib.util.find_spec("triton") is None:
        return "the 'triton' package is not installed (pip install triton)"
    try:
        import triton  # noqa: F401
    except Exception as exc:  # a broken install is reported, not raised at import time
        return f"'import triton' failed: {exc}"
    return None


def unavailable_reason(
    backend: str,
    device: torch.device | str,
    dtype: torch.dtype | None = None,
    block_size: int | None = None,
    head_dim: int | None = None,
) -> str | None:
    """Why ``backend`` cannot run on ``device`` (with the given cache dtype / block size /
    head dim when known), or None when it can."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    device = torch.device(device)
    if backend == "reference":
        return None
    if backend == "cpu":
        if device.type != "cpu":
            return f"needs CPU tensors (got {device.type})"
        if dtype is not None and not dtype.is_floating_point:
            return f"needs a floating-point cache, not {dtype}"
        return None
    if device.type == "cuda" and not torch.cuda.is_available():
        return "CUDA is not available in this process"
    if backend == "triton":
        if device.type != "cuda" and not (device.type == "cpu" and triton_interpreting()):
            return f"needs CUDA tensors (got {device.type}; set TRITON_INTERPRET=1 to interpret on CPU)"
        reason = triton_unavailable_reason()
        if reason is None and dtype not in (None, torch.float16, torch.bfloat16, torch.float32):
            reason = f"supports float16/bfloat16/float32, not {dtype}"
        return reason
    from batchinfer.kernels import flash  # imports the provider (once) to probe it

    return flash.unavailable_reason(device, dtype, block_size, head_dim)


def available_backends(
    device: torch.device | str,
    dtype: torch.dtype | None = None,
    block_size: int | None = None,
    head_dim: int | None = None,
) -> list[str]:
    """The backends that can run on ``device``, best first (e.g. ``['triton', 'reference']``)."""
    device = torch.device(device)
    names = PREFERENCE.get(device.type, ("reference",))
    return [b for b in names if unavailable_reason(b, device, dtype, block_size, head_dim) is None]


def select_backend(
    backend: str | None,
    device: torch.device,
    dtype: torch.dtype | None = None,
    block_size: int | None = None,
    head_dim: int | None = None,
) -> str:
    """Resolve ``backend`` (None = automatic) to the name of a backend that can run."""
    if backend is None:
        if device.type == "cpu":
            # The Triton interpreter is for tests, never an automatic choice.
            return "cpu" if unavailable_reason("cpu", device, dtype) is None else "reference"
        if device.type != "cuda":
            return "reference"
        return available_backends(device, dtype, block_size, head_dim)[0]
    reason = unavailable_reason(backend, device, dtype, block_size, head_dim)
    if reason is not None:
        raise RuntimeError(f"attention backend {backend!r} is unavailable: {reason}")
    return backend
