"""The kernels' backend registry: each backend a name and an availability check, and one
table-driven selection for every op family (attention, add_lora, fused_moe).

A family declares its table (in its ``dispatch.py``): its backends and, per device type, the order
to prefer them in. Every family resolves a ``backend`` argument the same way:

- ``None``: the first backend of the device's order that runs there and may be chosen automatically
  (the Triton interpreter on CPU may not: it is for tests);
- a known name: that backend, or ``RuntimeError("<op> backend 'x' is unavailable: <why>")``;
- any other name: ``ValueError`` listing the choices.

Checks see the device, dtype and sizes only, never a tensor, so selection costs no host sync and is
safe inside CUDA-graph capture. The Triton backend also runs CPU tensors when ``TRITON_INTERPRET=1``
(the Triton interpreter, used by the tests); without that variable it is CUDA-only.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

Check = Callable[[torch.device, torch.dtype | None, int | None, int | None], str | None]
"""``(device, dtype, block_size, head_dim) -> None`` when the backend can run there, else why not.
Sizes a family does not know are None."""


def anywhere(device: torch.device, dtype: torch.dtype | None, block_size: int | None,
             head_dim: int | None) -> None:
    """The check of a plain-torch backend: it runs on every device."""
    return None


@dataclass(frozen=True)
class Backend:
    """A backend: its name, why it cannot run somewhere (``unavailable``), and the device types on
    which ``backend=None`` may choose it (None: every type)."""

    name: str
    unavailable: Check
    automatic_on: frozenset[str] | None = None


@dataclass(frozen=True)
class Family:
    """An op family's table and the selection over it (see the module docstring)."""

    op: str  # names the op in errors: "attention", "add_lora", "fused_moe"
    backends: tuple[Backend, ...]  # every backend; errors list them in this order
    preference: Mapping[str, tuple[str, ...]]  # device type -> backend names, best first
    fallback: tuple[str, ...]  # the order for device types not in ``preference``
    _by_name: dict[str, Backend] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {b.name: b for b in self.backends})
        if len(self._by_name) != len(self.backends):
            raise ValueError(f"{self.op}: two backends share a name in {[b.name for b in self.backends]}")
        for order in (*self.preference.values(), self.fallback):
            unknown = [name for name in order if name not in self._by_name]
            if unknown:  # a typo in a table fails at import, not on the first call
                raise ValueError(f"{self.op}: preference names unknown backends {unknown}")

    @property
    def names(self) -> tuple[str, ...]:
        """Every backend's name, in the table's order."""
        return tuple(self._by_name)

    def unavailable_reason(self, backend: str, device: torch.device | str,
                           dtype: torch.dtype | None = None, block_size: int | None = None,
                           head_dim: int | None = None) -> str | None:
        """Why ``backend`` cannot run on ``device`` (with the given dtype / block size / head dim when
        known), or None when it can; ``ValueError`` for a name not in the table."""
        entry = self._by_name.get(backend)
        if entry is None:
            raise ValueError(f"unknown {self.op} backend {backend!r}; "
                             f"expected one of {', '.join(self.names)}")
        return entry.unavailable(torch.device(device), dtype, block_size, head_dim)

    def available_backends(self, device: torch.device | str,
                           dtype: torch.dtype | None = None, block_size: int | None = None,
                           head_dim: int | None = None) -> list[str]:
        """The backends that can run on ``device``, best first (e.g. ``['cpu', 'reference']``)."""
        device = torch.device(device)
        order = self.preference.get(device.type, self.fallback)
        return [name for name in order
                if self._by_name[name].unavailable(device, dtype, block_size, head_dim) is None]

    def select_backend(self, backend: str | None, device: torch.device | str,
                       dtype: torch.dtype | None = None, block_size: int | None = None,
                       head_dim: int | None = None) -> str:
        """Resolve ``backend`` (None = automatic) to the name of a backend that can run."""
        device = torch.device(device)
        if backend is not None:
            reason = self.unavailable_reason(backend, device, dtype, block_size, head_dim)
            if reason is not None:
                raise RuntimeError(f"{self.op} backend {backend!r} is unavailable: {reason}")
            return backend
        for name in self.preference.get(device.type, self.fallback):
            entry = self._by_name[name]
            automatic = entry.automatic_on is None or device.type in entry.automatic_on
            if automatic and entry.unavailable(device, dtype, block_size, head_dim) is None:
                return name
        raise RuntimeError(f"no {self.op} backend can run on {device.type} tensors "
                           f"(tried {', '.join(self.preference.get(device.type, self.fallback))})")


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


def _cpu(device: torch.device, dtype: torch.dtype | None, block_size: int | None,
         head_dim: int | None) -> str | None:
    if device.type != "cpu":
        return f"needs CPU tensors (got {device.type})"
    if dtype is not None and not dtype.is_floating_point:
        return f"needs a floating-point cache, not {dtype}"
    return None


def _triton(device: torch.device, dtype: torch.dtype | None, block_size: int | None,
            head_dim: int | None) -> str | None:
    if device.type == "cuda" and not torch.cuda.is_available():
        return "CUDA is not available in this process"
    if device.type != "cuda" and not (device.type == "cpu" and triton_interpreting()):
        return f"needs CUDA tensors (got {device.type}; set TRITON_INTERPRET=1 to interpret on CPU)"
    reason = triton_unavailable_reason()
    if reason is None and dtype not in (None, torch.float16, torch.bfloat16, torch.float32):
        reason = f"supports float16/bfloat16/float32, not {dtype}"
    return reason


def _flash(device: torch.device, dtype: torch.dtype | None, block_size: int | None,
           head_dim: int | None) -> str | None:
    if device.type == "cuda" and not torch.cuda.is_available():
        return "CUDA is not available in this process"
    from batchinfer.kernels import flash  # imports the provider (once) to probe it

    return flash.unavailable_reason(device, dtype, block_size, head_dim)


# The backends the families share (add_lora declares its own, any-device, ``cpu``).
REFERENCE = Backend("reference", anywhere)  # pure torch, the specification
CPU = Backend("cpu", _cpu)  # CPU tensors, floating point
TRITON = Backend("triton", _triton, automatic_on=frozenset({"cuda"}))  # on CPU only by name (interpreter)
FLASH = Backend("flash", _flash)
