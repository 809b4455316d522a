"""The Triton kernels against the reference. Without CUDA they run on CPU under the Triton
interpreter (``TRITON_INTERPRET=1``: the real kernel code, interpreted), on tiny shapes; with
CUDA the same tests run the compiled kernels.

The variable only works if it is set before triton is first imported (triton's own library
functions are jitted at import): tests/conftest.py sets it on machines without CUDA, and this
module sets it too when run on its own.
"""

from __future__ import annotations

import pytest
import torch
from triton_setup import DEVICE  # first: it checks triton is not imported yet

pytest.importorskip("triton")

from paged_batches import dense_reference, make_paged_batch  # noqa: E402

from batchinfer import kernels  # noqa: E402
from batchinfer.kernels import fused, triton_attention, triton_cache, triton_fused  # noqa: E402
from batchinfer.kernels.attention_config import AttentionConfig  # noqa: E402

# Interpreted bfloat16 casts truncate instead of rounding to nearest: allow one more ulp on CPU.
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
MIXED = [(1, 1), (37, 1), (19, 19), (50, 9), (5, 2), (24, 0)]  # see test_kernels_reference.MIXED
DECODE = [(1, 1), (37, 1), (70, 1), (16, 1)]


def _batch(seqs, num_heads, num_kv_heads, head_dim, block_size, dtype=torch.float32):
    return make_paged_batch(seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, DEVICE)


def _check(batch, dtype, window=None, config=None):
    out = triton_attention.paged_attention(*batch.args(), sliding_window=window, config=config)
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
    expected = dense_reference(batch, sliding_window=window).to(DEVICE)
    torch.testing.assert_close(out.float(), expected, **TOL[dtype])
    ref = kernels.paged_attention(*batch.args(), sliding_window=window, backend="reference")
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


# Each row covers features; together: head dims 64/80/96/128 (80, 96 padded), GQA 1/4/8, block
# sizes 16/32, fp32/bf16, sliding window, several key tiles per program (tile_n=16), prefill
# tiles of several queries (block_q > 1), the default launch configs, and split-K.
CASES = [
    # head_dim, heads, kv_heads, block, dtype, window, config
    (64, 4, 4, 16, torch.float32, None, AttentionConfig(16, 8, 16, 1)),
    (80, 8, 2, 32, torch.float32, None, None),
    (96, 16, 2, 16, torch.bfloat16, None, AttentionConfig(16, 2, 16, 1)),
    (128, 8, 2, 16, torch.bfloat16, 7, None),
    (64, 8, 1, 32, torch.float32, 20, AttentionConfig(16, 2, 16, 1)),
]


@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads,block_size,dtype,window,config", CASES)
def test_mixed_batch_matches_reference(head_dim, num_heads, num_kv_heads, block_size, dtype, window, config):
    _check(_batch(MIXED, num_heads, num_kv_heads, head_dim, block_size, dtype), dtype, window, config)


@pytest.mark.parametrize("dtype,window,config", [
    (torch.float32, None, AttentionConfig(16, 1, 16, 4)),  # split-K, including splits with no keys
    (torch.bfloat16, 9, AttentionConfig(16, 1, 16, 2)),  # split-K with a window (empty early splits)
    (torch.bfloat16, None, None),  # the default decode config
])
def test_decode_batch_matches_reference(dtype, window, config):
    _check(_batch(DECODE, 8, 2, 80, 16, dtype), dtype, window, config)


@pytest.mark.parametrize("dtype,window,config", [
    (torch.float32, None, AttentionConfig(16, 8, 16, 1)),  # prefill tiles, several key tiles
    (torch.bfloat16, 7, None),  # default config with a window
])
def test_softcap_matches_reference(dtype, window, config):
    batch = _batch(MIXED, 4, 2, 64, 16, dtype)
    out = triton_attention.paged_attention(*batch.args(), sliding_window=window, config=config, softcap=1.5)
    expected = dense_reference(batch, sliding_window=window, softcap=1.5).to(DEVICE)
    torch.testing.assert_close(out.float(), expected, **TOL[dtype])
    ref = kernels.paged_attention(*batch.args(), sliding_window=window, softcap=1.5, backend="reference")
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


def test_softcap_split_k_decode():
    batch = _batch(DECODE, 8, 2, 80, 16)
    out = kernels.paged_attention(*batch.args(), softcap=0.8, backend="triton")  # default decode config
    split = triton_attention.paged_attention(*batch.args(), softcap=0.8, config=AttentionConfig(16, 1, 16, 4))
    expected = dense_reference(batch, softcap=0.8).to(DEVICE)
    torch.testing.assert_close(out, expected, **TOL[torch.float32])
    torch.testing.assert_close(split, expected, **TOL[torch.float32])


def test_dispatcher_runs_triton_and_empty_batches():
    batch = _batch(MIXED, 4, 2, 64, 16)
    out = kernels.paged_attention(*batch.args(), backend="triton")
    torch.testing.assert_close(out, dense_reference(batch).to(DEVICE), **TOL[torch.float32])
    empty = _batch([], 4, 2, 64, 16)
    assert kernels.paged_attention(*empty.args(), backend="triton").shape == (0, 4, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_reference(dtype):
    gen = torch.Generator().manual_seed(1)
    kv = torch.randn(2, 7, 4, 80, generator=gen).to(dtype=dtype, device=DEVICE)
    k, v = kv[0], kv[1]  # views into one tensor: exercises strides
    slots = torch.tensor([5, -1, 16, 47, -1, 0, 33], device=DEVICE)
    caches = [torch.full((3, 16, 4, 80), 7.0, dtype=dtype, device=DEVICE) for _ in range(4)]
    kernels.write_kv(k, v, caches[0], caches[1], slots, backend="triton")
    kernels.write_kv(k, v, caches[2], caches[3], slots, backend="reference")
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_write_kv_strided_tokens_and_dtype_conversion():
    qkv = torch.randn(5, 3 * 2 * 64, device=DEVICE)
    k = qkv[:, 128:256].view(5, 2, 64)  # token stride 384, as when splitting a fused projection
    v = qkv[:, 256:].view(5, 2, 64)
    slots = torch.tensor([3, 2, 1, 0, -1], device=DEVICE, dtype=torch.int32)
    k_cache = torch.zeros(1, 16, 2, 64, dtype=torch.bfloat16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    triton_cache.write_kv(k, v, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache[0, :4].flip(0).float(), k[:4].float(), atol=0, rtol=2**-7)
    torch.testing.assert_close(v_cache[0, :4].flip(0).float(), v[:4].float(), atol=0, rtol=2**-7)
    assert k_cache[0, 4:].abs().sum() == 0


# bf16: one ulp on GPU (the interpreter truncates at each of up to three roundings), plus an atol
# for cancellations: torch rounds each bf16 product, the kernels round once at the end.
FUSED_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5),
             torch.bfloat16: dict(atol=3e-2, rtol=2**-7 if DEVICE == "cuda" else 2**-5)}


def _on_cpu(*tensors):
    """Copies on CPU, where the public ``fused`` functions take their torch path (the spec)."""
    return [t.cpu() if t is not None else None for t in tensors]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_torch(dtype, with_residual):
    gen = torch.Generator().manual_seed(2)
    x, res, weight = (torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)
                      for shape in ((5, 96), (5, 96), (96,)))
    residual = res if with_residual else None
    got = triton_fused.rms_norm(x, weight, 1e-6, residual)
    want = fused.rms_norm(*_on_cpu(x, weight), 1e-6, *_on_cpu(residual))
    if with_residual:
        (got, got_residual), (want, want_residual) = got, want
        torch.testing.assert_close(got_residual.cpu().float(), want_residual.float(), **FUSED_TOL[dtype])
    assert got.dtype == want.dtype
    torch.testing.assert_close(got.cpu().float(), want.float(), **FUSED_TOL[dtype])


def test_rms_norm_per_head_on_a_strided_view():
    """Qwen3's q/k norms: [T, H, D] heads of a fused projection, normalised over D."""
    qkv = torch.randn(4, 6 * 32, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    q = qkv[:, :128].view(4, 4, 32)  # token stride 192: not a plain [rows, C] matrix
    weight = torch.rand(32, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    got = triton_fused.rms_norm(q, weight, 1e-6)
    assert got.shape == (4, 4, 32)
    want = fused.rms_norm(*_on_cpu(q, weight), 1e-6)
    torch.testing.assert_close(got.cpu(), want, **FUSED_TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_torch(dtype):
    x = torch.randn(4, 2 * 40, generator=torch.Generator().manual_seed(3)).to(dtype=dtype, device=DEVICE)
    torch.testing.assert_close(triton_fused.silu_and_mul(x).cpu().float(),
                               fused.silu_and_mul(x.cpu()).float(), **FUSED_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rot_dim", [64, 32])  # full and partial rotary
def test_rotary_matches_torch(dtype, is_neox, rot_dim):
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(3, (4 + 2 + 2) * 64, generator=gen).to(dtype=dtype, device=DEVICE)
    q, k = qkv[:, :256].view(3, 4, 64), qkv[:, 256:384].view(3, 2, 64)  # strided views of one projection
    positions = torch.tensor([0, 7, 3], device=DEVICE)
    # Any table works (scaled RoPE variants such as llama3 differ only in the table's angles).
    angles = torch.rand(16, rot_dim // 2, generator=gen) * 100
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1).to(DEVICE)
    got_q, got_k = triton_fused.rotary_embedding(positions, q, k, cos_sin, is_neox)
    want_q, want_k = fused.rotary_embedding(*_on_cpu(positions, q, k, cos_sin), is_neox)
    torch.testing.assert_close(got_q.cpu().float(), want_q.float(), **FUSED_TOL[dtype])
    torch.testing.assert_close(got_k.cpu().float(), want_k.float(), **FUSED_TOL[dtype])
    if rot_dim < 64:
        assert torch.equal(got_q[..., rot_dim:], q[..., rot_dim:])
