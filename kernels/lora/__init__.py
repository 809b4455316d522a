"""``add_lora``: per-token LoRA deltas of a mixed batch (Punica / S-LoRA's segmented matmul).

::

    add_lora(y, x, lora_a, lora_b, mapping, backend=None) -> y   (in place)
        y:        [T, sum(out_i)]   the base projection's output, every slice side by side
        x:        [T, in]           the projection's input
        lora_a:   [L, S * R, in]    the A matrices of L adapter slots: slice i's are rows [i*R, (i+1)*R)
        lora_b:   S tensors [L, out_i, R]  slice i's B matrices (the adapter's scaling folded in)
        mapping:  LoRAMapping       which tokens use which slot (tokens of no adapter: untouched)

    For token t of slot s and each slice i (columns [off_i, off_i + out_i) of y, off_i = sum of
    the out_j before it): ``y[t, off_i:off_i+out_i] += (x[t] @ lora_a[s, i*R:(i+1)*R].T) @ lora_b[i][s].T``.

One call serves a fused projection (``qkv_proj``: S = 3 slices q, k, v; ``gate_up_proj``: 2) with
one shrink over all its slices. Ranks below R are zero-padded (the padding adds nothing);
``mapping.seg_ranks`` lets a backend skip it.

Backends (``dispatch.py``): ``reference`` (``reference.py``, the specification: every token's own
A and B gathered), ``cpu`` (``cpu.py``: one matmul pair per adapter over its tokens, plain torch;
the default on CPU, and on CUDA when Triton does not import) and ``triton`` (``triton_lora.py``:
segmented shrink and expand kernels; the default on CUDA). docs/kernels.md has more.
"""

from __future__ import annotations

import torch

from batchinfer.kernels.lora import cpu, dispatch, reference
from batchinfer.kernels.lora.dispatch import LORA_BACKENDS, available_backends
from batchinfer.kernels.lora.mapping import LoRAMapping


def add_lora(
    y: torch.Tensor,  # [T, sum(out_i)]
    x: torch.Tensor,  # [T, in]
    lora_a: torch.Tensor,  # [L, S * R, in]
    lora_b: tuple[torch.Tensor, ...] | list[torch.Tensor],  # S x [L, out_i, R]
    mapping: LoRAMapping,
    backend: str | None = None,
) -> torch.Tensor:
    """Add each token's adapter delta to ``y`` in place (see the module docstring); returns ``y``.

    Inputs are checked first (``ValueError`` naming the argument); ``backend`` None picks ``cpu``
    on CPU, ``triton`` on CUDA (``cpu`` when Triton does not import)."""
    dispatch.check_inputs(y, x, lora_a, lora_b, mapping)
    name = dispatch.select_backend(backend, x.device, x.dtype)
    if name == "reference":
        return reference.add_lora(y, x, lora_a, lora_b, mapping.token_slots)
    if name == "cpu":
        return cpu.add_lora(y, x, lora_a, lora_b, mapping)
    from batchinfer.kernels.lora import triton_lora

    return triton_lora.add_lora(y, x, lora_a, lora_b, mapping)


__all__ = ["LORA_BACKENDS", "LoRAMapping", "add_lora", "available_backends"]
