"""``kernels/registry.py``: one table-driven backend selection, used by attention, add_lora and fused_moe."""

from __future__ import annotations

import pytest
import torch

from batchinfer.kernels import dispatch
from batchinfer.kernels.lora import dispatch as lora_dispatch
from batchinfer.kernels.moe import dispatch as moe_dispatch
from batchinfer.kernels.registry import Backend, Family, anywhere

seen: list[tuple[torch.device, torch.dtype | None, int | None, int | None]] = []


def _needs_gpu_dtype(device: torch.device, dtype: torch.dtype | None, block_size: int | None,
                     head_dim: int | None) -> str | None:
    seen.append((device, dtype, block_size, head_dim))
    return None if dtype in (None, torch.float16) else f"no {dtype}"


def _never(device: torch.device, dtype: torch.dtype | None, block_size: int | None,
           head_dim: int | None) -> str | None:
    return "switched off"


TOY = Family(
    "toy_op",
    (Backend("fast", _needs_gpu_dtype), Backend("off", _never),
     Backend("test_only", anywhere, automatic_on=frozenset({"cuda"})), Backend("slow", anywhere)),
    {"cuda": ("off", "fast", "test_only", "slow"), "cpu": ("test_only", "slow")},
    fallback=("slow",),
)


def test_none_takes_the_first_available_backend_of_the_devices_order():
    assert TOY.select_backend(None, "cuda") == "fast"  # "off" comes first but cannot run
    assert TOY.select_backend(None, torch.device("cuda"), torch.float32) == "test_only"  # "fast" refuses fp32
    assert TOY.available_backends("cuda", torch.float32) == ["test_only", "slow"]
    assert TOY.available_backends("meta") == ["slow"]  # a device type without an order: the fallback
    assert TOY.select_backend(None, "meta") == "slow"


def test_a_backend_not_automatic_on_a_device_is_listed_and_selectable_by_name_only():
    assert TOY.available_backends("cpu") == ["test_only", "slow"]
    assert TOY.select_backend(None, "cpu") == "slow"
    assert TOY.select_backend("test_only", "cpu") == "test_only"


def test_unknown_name_is_a_value_error_listing_the_choices_in_table_order():
    for call in (lambda: TOY.select_backend("turbo", "cpu"), lambda: TOY.unavailable_reason("turbo", "cpu")):
        with pytest.raises(ValueError, match=r"^unknown toy_op backend 'turbo'; expected one of "
                                             r"fast, off, test_only, slow$"):
            call()
    assert TOY.names == ("fast", "off", "test_only", "slow")


def test_unavailable_name_is_a_runtime_error_saying_why():
    with pytest.raises(RuntimeError, match=r"^toy_op backend 'off' is unavailable: switched off$"):
        TOY.select_backend("off", "cuda")
    with pytest.raises(RuntimeError, match=r"^toy_op backend 'fast' is unavailable: no torch.bfloat16$"):
        TOY.select_backend("fast", "cpu", torch.bfloat16)
    assert TOY.unavailable_reason("off", "cpu") == "switched off"


def test_checks_get_a_device_and_sizes_never_a_tensor():
    seen.clear()
    TOY.select_backend("fast", "cuda:1", torch.float16, 16, 128)
    assert seen == [(torch.device("cuda:1"), torch.float16, 16, 128)]


def test_no_runnable_backend_is_a_runtime_error():
    family = Family("toy_op", (Backend("off", _never),), {}, fallback=("off",))
    with pytest.raises(RuntimeError, match="no toy_op backend can run on cpu tensors"):
        family.select_backend(None, "cpu")


def test_a_table_naming_an_unknown_backend_fails_when_declared():
    with pytest.raises(ValueError, match=r"toy_op: preference names unknown backends \['slw'\]"):
        Family("toy_op", (Backend("slow", anywhere),), {"cpu": ("slw",)}, fallback=("slow",))
    with pytest.raises(ValueError, match="toy_op: two backends share a name"):
        Family("toy_op", (Backend("slow", anywhere), Backend("slow", _never)), {}, fallback=("slow",))


@pytest.mark.parametrize(("module", "family", "names", "op"), [
    (dispatch, dispatch.ATTENTION, ("flash", "triton", "reference", "cpu"), "attention"),
    (lora_dispatch, lora_dispatch.LORA, ("triton", "reference", "cpu"), "add_lora"),
    (moe_dispatch, moe_dispatch.MOE, ("triton", "reference", "cpu"), "fused_moe"),
])
def test_every_family_selects_through_the_registry(module, family, names, op):
    assert isinstance(family, Family) and family.op == op and family.names == names
    assert module.select_backend == family.select_backend
    assert module.unavailable_reason == family.unavailable_reason
    assert module.available_backends == family.available_backends
    with pytest.raises(ValueError, match=f"unknown {op} backend 'x'; expected one of {', '.join(names)}"):
        module.select_backend("x", torch.device("cpu"))
    assert module.select_backend("reference", torch.device("meta")) == "reference"  # runs anywhere


def test_the_triton_interpreter_is_never_automatic_in_any_family(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cpu = torch.device("cpu")
    for family in (dispatch.ATTENTION, lora_dispatch.LORA, moe_dispatch.MOE):
        if "triton" in family.available_backends(cpu):  # triton imports here
            assert family.select_backend(None, cpu) == "cpu"
            assert family.select_backend("triton", cpu) == "triton"


def test_per_device_defaults_of_the_three_tables(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    meta = torch.device("meta")  # no backend but the plain-torch ones runs on meta tensors
    assert dispatch.select_backend(None, meta) == "reference"
    assert lora_dispatch.select_backend(None, meta) == "cpu"  # add_lora's cpu is plain torch: any device
    assert moe_dispatch.select_backend(None, meta) == "reference"
    assert dispatch.select_backend(None, torch.device("cpu"), torch.int8) == "reference"
    assert lora_dispatch.available_backends("cpu") == ["cpu", "reference"]
    assert moe_dispatch.available_backends("meta") == ["reference"]
