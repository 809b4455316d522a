"""``fused_moe``: the cpu and Triton backends against the reference (the specification).

Without CUDA the Triton kernel runs under the Triton interpreter (``TRITON_INTERPRET=1``, set by
tests/conftest.py before triton is imported) on tiny shapes; ``gpu`` tests run the compiled kernel.
"""

from __future__ import annotations

import pytest
import torch
from triton_setup import DEVICE  # first: it checks triton is not imported yet

from batchinfer.kernels.moe import MOE_BACKENDS, available_backends, fused_moe, reference
from batchinfer.kernels.moe.align import max_padded_rows, moe_align

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
# (tokens, experts, top_k, hidden, intermediate): T = 1 and 0, top_k = 1 and = E, sizes that are
# not multiples of the blocks, more pairs than one block holds.
SHAPES = [(1, 4, 2, 32, 48), (5, 4, 1, 32, 64), (33, 8, 2, 64, 40), (7, 1, 1, 16, 24), (20, 3, 3, 48, 32),
          (0, 4, 2, 32, 32)]


def _inputs(T, E, C, I, dtype=torch.float32, device=DEVICE, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, C, generator=gen)
    logits = torch.randn(T, E, generator=gen) * 2
    w13 = torch.randn(E, 2 * I, C, generator=gen) / C**0.5
    w2 = torch.randn(E, C, I, generator=gen) / I**0.5
    return [t.to(device=device, dtype=dtype) for t in (hidden, logits, w13, w2)]


def _naive(hidden, logits, w13, w2, top_k, renormalize):
    """Every token through every expert, zero weight off its top-k (independent of the spec's loop)."""
    probs = torch.softmax(logits.double(), -1)
    vals, ids = probs.topk(top_k, -1)
    if renormalize:
        vals = vals / vals.sum(-1, keepdim=True)
    dense = torch.zeros_like(probs).scatter_(1, ids, vals)  # [T, E]
    h = hidden.double()
    gate, up = torch.einsum("tc,eic->tei", h, w13.double()).chunk(2, -1)
    y = torch.einsum("tei,eci->tec", torch.nn.functional.silu(gate) * up, w2.double())
    return (y * dense[..., None]).sum(1)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-E{}-k{}-C{}-I{}".format(*s))
def test_reference_matches_dense_naive_moe(shape, renormalize):
    T, E, k, C, I = shape
    hidden, logits, w13, w2 = _inputs(T, E, C, I, device="cpu")
    out = fused_moe(hidden, logits, w13, w2, k, renormalize, backend="reference")
    assert out.shape == (T, C) and out.dtype == hidden.dtype
    naive = _naive(hidden, logits, w13, w2, k, renormalize)
    torch.testing.assert_close(out.double(), naive, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["cpu", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-E{}-k{}-C{}-I{}".format(*s))
def test_backends_match_the_reference(shape, dtype, backend):
    if backend == "cpu" and DEVICE != "cpu":
        pytest.skip("the cpu backend takes CPU tensors")
    T, E, k, C, I = shape
    hidden, logits, w13, w2 = _inputs(T, E, C, I, dtype)
    for renormalize in (True, False):
        ref = fused_moe(hidden, logits, w13, w2, k, renormalize, backend="reference")
        out = fused_moe(hidden, logits, w13, w2, k, renormalize, backend=backend)
        assert out.shape == ref.shape and out.dtype == ref.dtype
        torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_every_token_routed_to_one_expert(backend):
    if backend == "cpu" and DEVICE != "cpu":
        pytest.skip("the cpu backend takes CPU tensors")
    hidden, logits, w13, w2 = _inputs(40, 4, 32, 48)
    logits[:, 2] += 100.0  # expert 2 wins everywhere; top-2 makes the runner-up vary per token
    for k in (1, 2):
        ref = fused_moe(hidden, logits, w13, w2, k, backend="reference")
        out = fused_moe(hidden, logits, w13, w2, k, backend=backend)
        torch.testing.assert_close(out, ref, **TOL[torch.float32])
    # top-1, renormalised: exactly expert 2's MLP
    gate, up = (hidden @ w13[2].T).chunk(2, -1)
    torch.testing.assert_close(fused_moe(hidden, logits, w13, w2, 1, backend=backend),
                               (torch.nn.functional.silu(gate) * up) @ w2[2].T, **TOL[torch.float32])


def test_triton_config_override_uses_several_blocks_and_tiles():
    from batchinfer.kernels.moe import triton_moe

    hidden, logits, w13, w2 = _inputs(24, 4, 40, 36)
    weights, ids = reference.topk_routing(logits, 2, True)
    ref = reference.fused_experts(hidden, w13, w2, weights, ids)
    for cfg in (triton_moe.MoEConfig(16, 16, 16), triton_moe.MoEConfig(32, 64, 32)):
        torch.testing.assert_close(triton_moe.fused_experts(hidden, w13, w2, weights, ids, cfg), ref,
                                   **TOL[torch.float32])


@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_moe_align_sorts_pairs_by_expert_and_pads_each_to_the_block(block_m):
    gen = torch.Generator().manual_seed(3)
    E, T, k = 5, 13, 2
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    ids[ids == 4] = 1  # expert 4 gets no rows (and some tokens go to expert 1 twice: still two pairs)
    sorted_ids, expert_ids, num_rows = moe_align(ids, E, block_m)
    P = T * k
    assert sorted_ids.shape[0] == max_padded_rows(P, E, block_m) and sorted_ids.shape[0] % block_m == 0
    n = int(num_rows)
    assert n % block_m == 0 and (sorted_ids[n:] == P).all()
    real = sorted_ids[:n]
    assert sorted(real[real < P].tolist()) == list(range(P))  # every pair exactly once
    flat = ids.flatten()
    for b in range(n // block_m):
        rows = real[b * block_m:(b + 1) * block_m]
        rows = rows[rows < P].long()
        assert rows.numel() > 0 and (flat[rows] == expert_ids[b]).all()  # one expert per block
        assert rows.tolist() == sorted(rows.tolist())  # pair order inside an expert
    assert expert_ids[: n // block_m].tolist() == sorted(expert_ids[: n // block_m].tolist())


def test_input_errors_name_the_argument():
    hidden, logits, w13, w2 = _inputs(3, 4, 32, 48, device="cpu")
    cases = [
        ((hidden[0], logits, w13, w2, 2), "hidden must be"),
        ((hidden, logits[:, :3], w13, w2, 2), "router_logits must be"),
        ((hidden, logits, w13[:, :5], w2, 2), "w13 must be"),
        ((hidden, logits, w13, w2[:, :, :7], 2), "w2 must be"),
        ((hidden, logits, w13, w2, 0), "top_k must be in 1..4"),
        ((hidden, logits, w13, w2, 5), "top_k must be in 1..4"),
        ((hidden, logits, w13.double(), w2, 2), "w13 is torch.float64"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            fused_moe(*args)
    with pytest.raises(ValueError, match="activation 'gelu'"):
        fused_moe(hidden, logits, w13, w2, 2, activation="gelu")
    with pytest.raises(ValueError, match="unknown fused_moe backend 'flash'"):
        fused_moe(hidden, logits, w13, w2, 2, backend="flash")


def test_backend_selection_on_cpu(monkeypatch):
    assert set(MOE_BACKENDS) == {"triton", "reference", "cpu"}
    assert available_backends("cpu")[0] == "cpu"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "triton" not in available_backends("cpu")
    hidden, logits, w13, w2 = _inputs(3, 4, 32, 48, device="cpu")
    with pytest.raises(RuntimeError, match="fused_moe backend 'triton' is unavailable: needs CUDA"):
        fused_moe(hidden, logits, w13, w2, 2, backend="triton")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="fused_moe backend 'cpu' is unavailable: needs CPU tensors"):
            fused_moe(hidden.to("meta"), logits.to("meta"), w13.to("meta"), w2.to("meta"), 2, backend="cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_mixtral_sized_layer_matches_the_reference(dtype):
    """Compiled kernel, realistic widths (C 1024, I 1792, 8 experts, top-2), decode and prefill batches."""
    for T in (1, 64, 1000):
        hidden, logits, w13, w2 = _inputs(T, 8, 1024, 1792, dtype, device="cuda")
        ref = fused_moe(hidden, logits, w13, w2, 2, backend="reference")
        out = fused_moe(hidden, logits, w13, w2, 2)  # the default on CUDA: triton
        torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_decode_step_replays_in_a_cuda_graph():
    """No host syncs: the whole op (routing, alignment, both GEMMs) captures and replays."""
    hidden, logits, w13, w2 = _inputs(8, 8, 256, 512, torch.bfloat16, device="cuda")
    fused_moe(hidden, logits, w13, w2, 2)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(hidden, logits, w13, w2, 2)
    new_hidden, new_logits, _, _ = _inputs(8, 8, 256, 512, torch.bfloat16, device="cuda", seed=1)
    hidden.copy_(new_hidden)
    logits.copy_(new_logits)
    graph.replay()
    torch.cuda.synchronize()
    ref = fused_moe(hidden, logits, w13, w2, 2, backend="reference")
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


@pytest.mark.slow  # ~10 s: the interpreter
def test_gpu_bench_dry_run_prints_its_table(capsys):
    """bench/moe_gpu.py end to end on CPU (tiny shapes, the kernel interpreted)."""
    if DEVICE != "cpu":
        pytest.skip("the dry run interprets Triton on CPU; with CUDA the gpu_check section runs the real one")
    from bench_scripts import bench_script

    with bench_script("moe_gpu") as bench:
        bench.DRY.update(tokens=(1, 9))
        assert bench.main(["--dry-run", "--iters", "1"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("== "):].splitlines()
    assert len(table) == 1 + 2 * 2
    assert all(line.split()[-1] == "PASS" for line in table[1:] if "triton" in line)
