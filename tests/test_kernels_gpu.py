"""Compiled kernels on a real GPU: realistic shapes, every backend against the reference, CUDA-graph
capture and torch.compile (inductor). Marked ``gpu``: skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from paged_batches import make_paged_batch

from batchinfer import kernels

pytestmark = pytest.mark.gpu

# Long contexts (many key tiles, split-K on small batches), prefix-cached chunks, decodes.
SEQS = [(1, 1), (3000, 1), (777, 1), (2048, 512), (130, 130), (4100, 1)]
BF16 = dict(atol=2e-2, rtol=2e-2)


def _batch(seqs, dtype=torch.bfloat16, head_dim=128, num_heads=32, num_kv_heads=8, block_size=16):
    return make_paged_batch(seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, "cuda")


@pytest.mark.parametrize("backend", ["triton", "flash"])
@pytest.mark.parametrize("window", [None, 1024])
def test_backends_match_reference_on_long_contexts(backend, window):
    if backend not in kernels.available_backends("cuda", torch.bfloat16, 16, 128):
        pytest.skip(f"{backend} is not available here")
    batch = _batch(SEQS)
    ref = kernels.paged_attention(*batch.args(), sliding_window=window, backend="reference")
    out = kernels.paged_attention(*batch.args(), sliding_window=window, backend=backend)
    torch.testing.assert_close(out, ref, **BF16)


@pytest.mark.parametrize("num_seqs", [1, 8, 64])
def test_decode_split_k_defaults_match_reference(num_seqs):
    from batchinfer.kernels import triton_attention  # imported lazily, like the dispatcher does

    batch = _batch([(4096 - 37 * i, 1) for i in range(num_seqs)])
    cfg = triton_attention.choose_config(num_seqs, num_seqs, 32, 8, batch.block_tables.shape[1] * 16,
                                         torch.cuda.get_device_properties(0).multi_processor_count)
    out = triton_attention.paged_attention(*batch.args())
    ref = kernels.paged_attention(*batch.args(), backend="reference")
    torch.testing.assert_close(out, ref, **BF16)
    assert num_seqs > 1 or cfg.num_splits > 1  # the single long sequence did take the split-K path


def test_default_backend_on_cuda_is_a_fused_one():
    assert kernels.available_backends("cuda")[0] in ("flash", "triton")


def test_cuda_graph_replay_matches_eager():
    batch = _batch([(300, 1), (1000, 1), (17, 1), (64, 1)])
    k_new = torch.randn(4, 8, 128, device="cuda", dtype=torch.bfloat16)
    slots = (batch.block_tables[:, 0].long() * 16 + 15)  # overwrite one cached key of each sequence
    caches = batch.k_cache.clone(), batch.v_cache.clone()

    def step():
        kernels.write_kv(k_new, k_new, *caches, slots, backend="triton")
        return kernels.paged_attention(batch.q, *caches, *batch.args()[3:], backend="triton")

    eager = step()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up (compiles) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    batch.q.mul_(-1)  # new inputs in the same buffers
    graph.replay()
    torch.testing.assert_close(captured, step(), atol=0, rtol=0)
    assert not torch.equal(captured, eager)


def test_torch_compile_inductor_with_custom_ops():
    batch = _batch([(300, 1), (1000, 20), (17, 17)])

    def attend(q, k_cache, v_cache, tables, cu, lens):
        return kernels.paged_attention(q * 1.0, k_cache, v_cache, tables, cu, lens) + 0.0

    compiled = torch.compile(attend, fullgraph=True)
    torch.testing.assert_close(compiled(*batch.args()), attend(*batch.args()), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_ops_take_triton_on_cuda(dtype):
    from batchinfer.kernels import fused

    x = torch.randn(64, 4096, device="cuda", dtype=dtype)
    res = torch.randn_like(x)
    w = torch.randn(4096, device="cuda", dtype=dtype)
    got, got_res = fused.rms_norm(x, w, 1e-5, res)
    want, want_res = fused.rms_norm(x.cpu(), w.cpu(), 1e-5, res.cpu())
    torch.testing.assert_close(got.cpu(), want, atol=1e-2, rtol=2**-7)
    torch.testing.assert_close(got_res.cpu(), want_res, atol=0, rtol=0)
