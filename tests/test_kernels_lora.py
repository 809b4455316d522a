"""``add_lora``: the cpu and Triton backends against the reference (the specification).

Without CUDA the Triton kernels run under the Triton interpreter (``TRITON_INTERPRET=1``, set by
tests/conftest.py before triton is imported) on tiny shapes; ``gpu`` tests run them compiled.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from triton_setup import DEVICE  # first: it checks triton is not imported yet

from batchinfer.kernels.lora import LORA_BACKENDS, LoRAMapping, add_lora, available_backends, dispatch
from batchinfer.kernels.lora.mapping import TRITON_BLOCK_M

TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}  # atol = rtol, by dtype


def _close(out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
RANKS = (8, 3, 5, 1)  # four slots, max rank 8: slots 1-3 zero-padded
# Each step mixes base tokens (-1) with adapters; slot 2's tokens come before, between and after
# slot 0's (segments are not contiguous in the step); slot 3 is loaded but unused in some.
STEPS = {
    "mixed": [2, 2, 0, -1, 2, 1, 3, -1, 0, 0, 3, 2, 1],
    "interleaved": [2, 0, 2, -1, 0, 2],
    "single-token": [1],
    "one-adapter-all": [3] * 5,
    # an engine's step ordered by slot: the adapter tokens are one run (the cpu path's views)
    "sorted-by-slot": [-1, -1, 0, 0, 0, 1, 3, 3],
}


def _weights(out_sizes, rank=8, ranks=RANKS, in_features=32, dtype=torch.float32, device=DEVICE, seed=0):
    """Stacked A [L, S*R, in] and Bs S x [L, out_i, R], zero beyond each slot's rank."""
    gen = torch.Generator().manual_seed(seed)
    num_slices = len(out_sizes)
    a = torch.randn(len(ranks), num_slices * rank, in_features, generator=gen) / in_features**0.5
    bs = [torch.randn(len(ranks), out, rank, generator=gen) for out in out_sizes]
    for slot, r in enumerate(ranks):
        a[slot].view(num_slices, rank, in_features)[:, r:] = 0
        for b in bs:
            b[slot, :, r:] = 0
    return a.to(device, dtype), [b.to(device, dtype) for b in bs]


def _activations(num_tokens, in_features, out_features, dtype=torch.float32, device=DEVICE, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, in_features, generator=gen)
    y = torch.randn(num_tokens, out_features, generator=gen)
    return x.to(device, dtype), y.to(device, dtype)


def _naive(y, x, a, bs, slots):
    """Token by token in float64, straight from the formula (independent of the reference's einsums)."""
    out = y.double().clone()
    rank = a.shape[1] // len(bs)
    for t, s in enumerate(slots):
        if s < 0:
            continue
        offset = 0
        for i, b in enumerate(bs):
            h = a[s, i * rank:(i + 1) * rank].double() @ x[t].double()  # [R]
            out[t, offset:offset + b.shape[1]] += b[s].double() @ h
            offset += b.shape[1]
    return out


def _run(backend, out_sizes, slots, dtype=torch.float32, in_features=32, seed=0):
    """(input y, backend's y, reference's y) for one step."""
    a, bs = _weights(out_sizes, in_features=in_features, dtype=dtype, seed=seed)
    x, y = _activations(len(slots), in_features, sum(out_sizes), dtype, seed=seed + 1)
    mapping = LoRAMapping.build(np.array(slots), RANKS, DEVICE)
    assert mapping is not None
    ref = add_lora(y.clone(), x, a, bs, mapping, backend="reference")
    out = y.clone()
    assert add_lora(out, x, a, bs, mapping, backend=backend) is out  # in place
    return y, out, ref


@pytest.mark.parametrize("step", STEPS, ids=str)
@pytest.mark.parametrize("out_sizes", [(24,), (16, 40), (24, 8, 8)], ids=lambda o: f"S{len(o)}")
def test_reference_matches_the_formula_token_by_token(out_sizes, step):
    slots = STEPS[step]
    y, _, ref = _run("reference", out_sizes, slots)
    a, bs = _weights(out_sizes)
    x, _ = _activations(len(slots), 32, sum(out_sizes), seed=1)
    torch.testing.assert_close(ref.double(), _naive(y, x, a, bs, slots), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["cpu", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("out_sizes", [(24,), (16, 40), (24, 8, 8)], ids=lambda o: f"S{len(o)}")
@pytest.mark.parametrize("step", STEPS, ids=str)
def test_backends_match_the_reference(step, out_sizes, dtype, backend):
    slots = STEPS[step]
    y, out, ref = _run(backend, out_sizes, slots, dtype)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    _close(out, ref, TOL[dtype])
    base = torch.tensor(slots, device=DEVICE) < 0
    assert torch.equal(out[base], y[base])  # tokens of no adapter: bit for bit untouched
    assert not torch.equal(out[~base], y[~base])  # the others did get a delta


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_segments_longer_than_a_block_and_unequal_slices(backend):
    """40 tokens of one slot span 3 Triton blocks (the last partial); slot 1 only a few rows."""
    gen = np.random.default_rng(5)
    slots = gen.choice([-1, 0, 1, 2, 2, 2], size=70).tolist()
    assert slots.count(2) > 2 * TRITON_BLOCK_M
    y, out, ref = _run(backend, (40, 24, 16), slots, in_features=48)
    _close(out, ref, TOL[torch.float32])
    base = torch.tensor(slots, device=DEVICE) < 0
    assert torch.equal(out[base], y[base])


def test_triton_launch_configs_split_k_and_several_tiles():
    """Forced configs: split-K with float32 atomics, several column tiles in both kernels."""
    from batchinfer.kernels.lora import triton_lora

    slots = STEPS["mixed"]
    out_sizes = (40, 24, 24)
    a, bs = _weights(out_sizes, in_features=96)
    x, y = _activations(len(slots), 96, sum(out_sizes))
    mapping = LoRAMapping.build(np.array(slots), RANKS, DEVICE)
    assert mapping is not None
    ref = add_lora(y.clone(), x, a, bs, mapping, backend="reference")
    for cfg in (triton_lora.LoRAConfig(16, 16, 3, 16), triton_lora.LoRAConfig(16, 32, 1, 32)):
        out = triton_lora.add_lora(y.clone(), x, a, bs, mapping, cfg)
        _close(out, ref, TOL[torch.float32])
    assert triton_lora.choose_config(4, 48, 4096).split_k == 16  # decode: few blocks, 16 parts of 256
    assert triton_lora.choose_config(4, 48, 64).split_k == 1  # too short a reduction to split
    assert triton_lora.choose_config(512, 48, 4096).split_k == 1  # prefill: blocks enough


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_a_rank_zero_slot_adds_nothing(backend):
    ranks = (8, 0, 5, 1)
    a, bs = _weights((16, 8), ranks=ranks)
    slots = [1, 0, 1, 2, -1, 1]
    x, y = _activations(len(slots), 32, 24)
    mapping = LoRAMapping.build(np.array(slots), ranks, DEVICE)
    assert mapping is not None
    out = add_lora(y.clone(), x, a, bs, mapping, backend=backend)
    _close(out, add_lora(y.clone(), x, a, bs, mapping, backend="reference"), TOL[torch.float32])
    untouched = torch.tensor([s in (-1, 1) for s in slots], device=DEVICE)
    assert torch.equal(out[untouched], y[untouched])


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_strided_inputs_and_a_hand_made_mapping(backend):
    """x a column slice of a wider tensor, y rows strided; a mapping without a block table."""
    slots = STEPS["interleaved"]
    a, bs = _weights((16, 8))
    wide_x, wide_y = _activations(len(slots), 64, 40)
    x, y = wide_x[:, 8:40], wide_y[:, 4:28]
    built = LoRAMapping.build(np.array(slots), RANKS, DEVICE)
    assert built is not None
    by_hand = LoRAMapping(built.token_slots, built.token_indices, built.seg_slots, built.seg_bounds,
                          built.seg_ranks)
    assert by_hand.block_table is None
    ref = add_lora(y.clone(), x, a, bs, built, backend="reference")
    before = wide_y.clone()
    add_lora(y, x, a, bs, by_hand, backend=backend)
    _close(y, ref, TOL[torch.float32])
    assert torch.equal(wide_y[:, :4], before[:, :4]) and torch.equal(wide_y[:, 28:], before[:, 28:])
    y_t = y.clone().t().contiguous().t()  # column-major y: stride (1, T)
    add_lora(y_t, x, a, bs, built, backend=backend)
    _close(y_t, add_lora(ref.clone(), x, a, bs, built, backend="reference"), TOL[torch.float32])


def test_mapping_knows_when_the_adapter_tokens_are_one_run():
    first = {name: LoRAMapping.build(np.array(slots), RANKS).first_row for name, slots in STEPS.items()}
    assert first == {"mixed": None, "interleaved": None, "single-token": 0, "one-adapter-all": 0,
                     "sorted-by-slot": 2}
    assert LoRAMapping.build(np.array([0, -1, 1]), RANKS).first_row is None  # a base token inside the run


def test_mapping_groups_tokens_by_slot_and_cuts_blocks():
    m = LoRAMapping.build(np.array([2, 0, 2, -1, 0, 2]), [4, 8, 2], "cpu")
    assert m is not None
    assert m.token_slots.tolist() == [2, 0, 2, -1, 0, 2] and m.token_slots.dtype == torch.int64
    assert m.token_indices.tolist() == [1, 4, 0, 2, 5]  # slot 0's, then slot 2's, step order within
    assert (m.seg_slots, m.seg_bounds, m.seg_ranks) == ((0, 2), (0, 2, 5), (4, 2))
    assert m.block_table is not None and m.block_table.tolist() == [[0, 2, 0, 4], [2, 5, 2, 2]]
    long = LoRAMapping.build(np.array([1] * 35 + [0] * 3), [2, 6], "cpu")
    assert long is not None and long.block_table is not None
    bm = TRITON_BLOCK_M
    assert long.block_table.tolist() == [[0, 3, 0, 2], [3, 38, 1, 6], [3 + bm, 38, 1, 6],
                                         [3 + 2 * bm, 38, 1, 6]]
    assert LoRAMapping.build(np.array([-1, -1, -1]), [4], "cpu") is None
    assert LoRAMapping.build(np.zeros(0, dtype=np.int64), [4], "cpu") is None


@settings(max_examples=25, deadline=None)
@given(slots=st.lists(st.integers(-1, 3), min_size=1, max_size=40),
       out_sizes=st.lists(st.integers(1, 20), min_size=1, max_size=3))
def test_cpu_matches_the_reference_on_random_steps(slots, out_sizes):
    a, bs = _weights(tuple(out_sizes), device="cpu")
    x, y = _activations(len(slots), 32, sum(out_sizes), device="cpu")
    mapping = LoRAMapping.build(np.array(slots), RANKS, "cpu")
    if mapping is None:
        assert all(s < 0 for s in slots)
        return
    ref = add_lora(y.clone(), x, a, bs, mapping, backend="reference")
    out = add_lora(y.clone(), x, a, bs, mapping, backend="cpu")
    _close(out, ref, TOL[torch.float32])
    base = torch.tensor(slots) < 0
    assert torch.equal(out[base], y[base])
    table = mapping.block_table
    assert table is not None
    covered = sorted(r for start, end, _, _ in table.tolist()
                     for r in range(start, min(start + TRITON_BLOCK_M, end)))
    assert covered == list(range(len(mapping.token_indices)))  # every sorted row in exactly one block


def test_input_errors_name_the_problem():
    slots = np.array([0, 1, -1])
    a, bs = _weights((16, 8), device="cpu")  # lora_a [4, 16, 32]
    x, y = _activations(3, 32, 24, device="cpu")
    m = LoRAMapping.build(slots, RANKS, "cpu")
    assert m is not None
    cases = [
        ((y, x[0], a, bs, m), "x must be"),
        ((y, x, a[:, :, :16], bs, m), r"lora_a must be \[num_slots, 2 \* max_rank, 32\]"),
        ((y, x, a[:, :15], bs, m), "lora_a must be"),
        ((y, x, a, bs[0], m), "lora_b must be a non-empty list"),
        ((y, x, a, [], m), "lora_b must be a non-empty list"),
        ((y, x, a, [bs[0], bs[1][:, :, :4]], m), r"lora_b\[1\] must be \[4, out_features, 8\]"),
        ((y, x, a, [bs[0], bs[1][:2]], m), r"lora_b\[1\] must be \[4, out_features, 8\]"),
        ((y[:, :20], x, a, bs, m), r"y must be \[3, 24\]"),
        ((y[:2], x, a, bs, m), r"y must be \[3, 24\]"),
        ((y[:2], x[:2], a, bs, m), r"mapping.token_slots must be \[2\]"),
        ((y, x, a[:1], [b[:1] for b in bs], m), r"mapping uses slots \[0, 1\] but lora_a has 1 slots"),
        ((y, x, a.double(), [b.double() for b in bs], m), "lora_a is torch.float64 but x is torch.float32"),
        ((y.bfloat16(), x, a, bs, m), "y is torch.bfloat16 but x is torch.float32"),
        ((y, x, a, [bs[0], bs[1].half()], m), r"lora_b\[1\] is torch.float16"),
        ((y.long(), x.long(), a.long(), [b.long() for b in bs], m), "x must be floating point"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            add_lora(*args)
    too_big = LoRAMapping.build(slots, [9, 1, 1, 1], "cpu")
    assert too_big is not None
    with pytest.raises(ValueError, match=r"seg_ranks \[9, 1\] exceed the stacked max_rank 8"):
        add_lora(y, x, a, bs, too_big)
    with pytest.raises(ValueError, match="unknown add_lora backend 'punica'; expected one of triton"):
        add_lora(y, x, a, bs, m, backend="punica")
    if not torch.cuda.is_available():
        on_meta = LoRAMapping.build(slots, RANKS, "meta")
        assert on_meta is not None
        with pytest.raises(ValueError, match="mapping.token_slots is on meta but x is on cpu"):
            add_lora(y, x, a, bs, on_meta)


def test_backend_selection(monkeypatch):
    assert set(LORA_BACKENDS) == {"triton", "reference", "cpu"}
    assert dispatch.select_backend(None, torch.device("cpu")) == "cpu"
    assert available_backends("cpu")[0] == "cpu"
    if not torch.cuda.is_available():  # triton cannot run "cuda" here: the torch path takes over
        assert dispatch.select_backend(None, torch.device("cuda")) == "cpu"
    else:
        assert dispatch.select_backend(None, torch.device("cuda"), torch.bfloat16) == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "triton" not in available_backends("cpu")
    a, bs = _weights((8,), device="cpu")
    x, y = _activations(2, 32, 8, device="cpu")
    m = LoRAMapping.build(np.array([0, 1]), RANKS, "cpu")
    assert m is not None
    with pytest.raises(RuntimeError, match="add_lora backend 'triton' is unavailable: needs CUDA"):
        add_lora(y, x, a, bs, m, backend="triton")


# ---- compiled, on CUDA (skipped without it) ----

# Llama-3-8B's qkv_proj: in 4096, q 4096 / k 1024 / v 1024; 8 adapters of rank 16 (some lower).
GPU_OUT = (4096, 1024, 1024)
GPU_RANKS = (16, 8, 16, 4, 16, 16, 12, 16)


def _gpu_step(num_tokens, dtype, seed=0, base_share=0.25):
    gen = np.random.default_rng(seed)
    slots = gen.integers(0, len(GPU_RANKS), size=num_tokens)
    slots[gen.random(num_tokens) < base_share] = -1
    if (slots < 0).all():
        slots[0] = 0
    a, bs = _weights(GPU_OUT, rank=16, ranks=GPU_RANKS, in_features=4096, dtype=dtype, device="cuda",
                     seed=seed)
    x, y = _activations(num_tokens, 4096, sum(GPU_OUT), dtype, device="cuda", seed=seed + 1)
    mapping = LoRAMapping.build(slots, GPU_RANKS, "cuda")
    assert mapping is not None
    return y, x, a, bs, mapping, torch.from_numpy(slots).cuda() < 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_gpu_triton_matches_the_reference(dtype):
    """Decode (1, 64 tokens: split-K) and prefill (2048) steps of a qkv_proj-shaped group."""
    tol = 1e-3 if dtype == torch.float32 else 2e-2
    for num_tokens in (1, 64, 2048):
        y, x, a, bs, mapping, base = _gpu_step(num_tokens, dtype)
        ref = add_lora(y.clone(), x, a, bs, mapping, backend="reference")
        out = add_lora(y.clone(), x, a, bs, mapping)  # the default on CUDA: triton
        _close(out, ref, tol)
        assert torch.equal(out[base], y[base])
        cpu_path = add_lora(y.clone(), x, a, bs, mapping, backend="cpu")
        _close(cpu_path, ref, tol)
