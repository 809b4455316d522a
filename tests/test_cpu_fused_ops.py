"""The compiled CPU extension's fused ops (kernels/cpu_ext: fused_ops.cpp, gemv.cpp) against the torch
code they replace, their input checks, the switch, and the engine running on them."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from torch import nn

from batchinfer import LLM, SamplingParams
from batchinfer.kernels import fused, reference
from batchinfer.kernels.cpu_ext import decode, elementwise, gemv
from batchinfer.workers.quant.dense import GemvLinear

can_build = shutil.which(os.environ.get("CXX", "c++")) is not None and shutil.which("ninja") is not None
pytestmark = pytest.mark.skipif(not can_build, reason="no C++ compiler or ninja: the extension cannot build")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    assert decode.library() is not None, decode.unavailable_reason()


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# -- rms_norm ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_the_torch_code(dtype, with_residual):
    """Same roundings as ``_rms_norm_torch`` (16-bit dtypes: equal but for a rare last-place tie; the
    sum of squares is added in another order), and the new residual stream bit for bit."""
    g = _gen(0)
    x = (torch.randn(7, 96, generator=g) * 3).to(dtype)
    residual = torch.randn(7, 96, generator=g).to(dtype) if with_residual else None
    weight = torch.randn(96, generator=g).to(dtype)
    got = elementwise.rms_norm(x, weight, 1e-6, residual)
    summed = x if residual is None else x + residual
    want = fused._rms_norm_torch(summed, weight, 1e-6)
    normed = got[0] if with_residual else got
    if with_residual:
        assert torch.equal(got[1], summed)
    assert normed.dtype == dtype and normed.shape == x.shape
    torch.testing.assert_close(normed.float(), want.float(), rtol=1e-5 if dtype == torch.float32 else 1e-2,
                               atol=1e-5 if dtype == torch.float32 else 1e-2)
    if dtype != torch.float32:
        assert (normed != want).float().mean() < 0.01


def test_rms_norm_takes_a_strided_row_view():
    """Rows of a wider tensor (a unit last stride, any row stride) are read in place."""
    g = _gen(1)
    wide = torch.randn(4, 160, generator=g).to(torch.bfloat16)
    x = wide[:, :64]
    weight = torch.randn(64, generator=g).to(torch.bfloat16)
    want = fused._rms_norm_torch(x.contiguous(), weight, 1e-5)
    got = elementwise.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


def test_rms_norm_refuses_mismatched_inputs():
    x = torch.randn(2, 32, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="weight and x must share a dtype"):
        elementwise.rms_norm(x, torch.ones(32), 1e-5)
    with pytest.raises(RuntimeError, match=r"weight must be \[32\]"):
        elementwise.rms_norm(x, torch.ones(31, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(RuntimeError, match="residual must be x's shape and dtype"):
        elementwise.rms_norm(x, torch.ones(32, dtype=torch.bfloat16), 1e-5,
                             torch.zeros(3, 32, dtype=torch.bfloat16))


def test_kernels_rms_norm_routes_cpu_tensors_to_the_extension(monkeypatch):
    """``kernels.fused.rms_norm`` answers from the extension by default and from torch with the
    switch off; both agree."""
    g = _gen(2)
    x = torch.randn(3, 64, generator=g).to(torch.bfloat16)
    r = torch.randn(3, 64, generator=g).to(torch.bfloat16)
    w = torch.randn(64, generator=g).to(torch.bfloat16)
    calls = []
    real = elementwise.rms_norm
    monkeypatch.setattr(elementwise, "rms_norm", lambda *a: calls.append(1) or real(*a))
    on = fused.rms_norm(x, w, 1e-5, r)
    monkeypatch.setenv(decode.ENV, "0")
    off = fused.rms_norm(x, w, 1e-5, r)
    assert calls == [1]
    assert torch.equal(on[1], off[1])
    torch.testing.assert_close(on[0].float(), off[0].float(), rtol=1e-2, atol=1e-2)


# -- rotary_cache ----------------------------------------------------------------------------------

def _qkv(dtype, tokens=6, heads=4, kv_heads=2, head_dim=32, seed=3):
    """q, k, v as views of one projection output, as the attention layer makes them."""
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=_gen(seed)).to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return (q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim),
            v.view(tokens, kv_heads, head_dim))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rot_dim", [32, 16])  # 16: partial rotary, the last channels pass through
def test_rotary_cache_is_the_torch_path_bit_for_bit(dtype, is_neox, rot_dim):
    q, k, v = _qkv(dtype)
    table = torch.randn(100, rot_dim, generator=_gen(4))
    positions = torch.tensor([0, 5, 99, 17, 17, 3])
    slots = torch.tensor([0, 9, -1, 31, 4, 12], dtype=torch.int32)  # -1: nothing written
    k_cache = torch.full((4, 8, 2, 32), 7.0, dtype=dtype)
    v_cache = torch.full((4, 8, 2, 32), 7.0, dtype=dtype)
    want_q, want_k = fused.rotary_embedding(positions, q, k, table, is_neox)
    want_kc, want_vc = k_cache.clone(), v_cache.clone()
    reference.write_kv(want_k, v, want_kc, want_vc, slots)

    elementwise.rotary_cache(positions, q, k, table, is_neox, v, k_cache, v_cache, slots)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(k_cache, want_kc) and torch.equal(v_cache, want_vc)


def test_rotary_cache_without_caches_only_rotates():
    q, k, _ = _qkv(torch.bfloat16)
    table = torch.randn(50, 32, generator=_gen(5))
    positions = torch.arange(6)
    want_q, want_k = fused.rotary_embedding(positions, q, k, table)
    elementwise.rotary_cache(positions, q, k, table)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)


def test_rotary_cache_checks_everything_before_writing():
    """A position or slot out of range raises IndexError naming the token; q, k and the caches are
    left as they were."""
    q, k, v = _qkv(torch.float32)
    table = torch.randn(10, 32, generator=_gen(6))
    cache = torch.zeros(2, 4, 2, 32), torch.zeros(2, 4, 2, 32)
    before = q.clone(), k.clone()
    with pytest.raises(IndexError, match="token 2 has position 10, outside the table's 10"):
        elementwise.rotary_cache(torch.tensor([0, 1, 10, 2, 3, 4]), q, k, table, True, v, *cache,
                                 torch.arange(6))
    with pytest.raises(IndexError, match="token 5 has slot 8, outside the cache's 8"):
        elementwise.rotary_cache(torch.arange(6), q, k, table, True, v, *cache,
                                 torch.tensor([0, 1, 2, 3, 4, 8]))
    assert torch.equal(q, before[0]) and torch.equal(k, before[1])
    assert not cache[0].any() and not cache[1].any()
    with pytest.raises(RuntimeError, match="come together"):
        elementwise.rotary_cache(torch.arange(6), q, k, table, True, v, cache[0], None, torch.arange(6))


@pytest.mark.parametrize("mode", ["auto", "0"])
def test_rotary_embedding_into_cache_either_way(mode, monkeypatch):
    """``kernels.fused.rotary_embedding_into_cache``: the same rotated q / k and cache contents with
    the extension (in place) and without it (the torch path and ``kernels.write_kv``)."""
    monkeypatch.setenv(decode.ENV, mode)
    q, k, v = _qkv(torch.bfloat16)
    table = torch.randn(64, 32, generator=_gen(7))
    positions, slots = torch.tensor([1, 2, 3, 4, 5, 6]), torch.tensor([6, 5, 4, 3, 2, 1])
    want_q, want_k = fused.rotary_embedding(positions, q, k, table)
    caches = torch.zeros(2, 4, 2, 32, dtype=torch.bfloat16), torch.zeros(2, 4, 2, 32, dtype=torch.bfloat16)
    got_q, got_k = fused.rotary_embedding_into_cache(positions, q, k, v, table, *caches, slots)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert (got_q is q) == (mode == "auto")  # rotated in place only by the extension
    assert torch.equal(caches[0].view(-1, 2, 32)[slots], want_k)
    assert torch.equal(caches[1].view(-1, 2, 32)[slots], v)


# -- silu_and_mul ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [64, 777])  # 777: past the 16 / 32-value vectors, a tail
def test_silu_and_mul_matches_the_torch_code(dtype, inter):
    """16-bit dtypes: torch's roundings (silu rounded, then the product), so equal but where the
    float32 silu's last bits straddle a rounding tie; float32: within 2 ulp of float64, as torch is."""
    x = (torch.randn(37, 2 * inter, generator=_gen(11)) * 6).to(dtype)
    got, want = elementwise.silu_and_mul(x), fused._silu_and_mul_torch(x)
    assert got.dtype == dtype and got.shape == (37, inter) and got.is_contiguous()
    if dtype == torch.float32:
        exact = torch.nn.functional.silu(x[:, :inter].double()) * x[:, inter:].double()
        err = ((got.double() - exact).abs() / exact.abs().clamp_min(1e-30)).max().item()
        assert err < 2.5e-7, err  # measured 2.1e-7 over [-87, 100]; torch's own 1.7e-7
    else:
        assert (got != want).float().mean() < 1e-3
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-3)


def test_silu_and_mul_edge_values():
    """Zeros, saturation both ways (e^-|g| underflows below -87: 0 where torch gives ~1e-36), infinities and
    NaN as torch has them."""
    gate = torch.tensor([0.0, -0.0, 30.0, -30.0, 100.0, -100.0, float("inf"), float("-inf"), float("nan"),
                         1e-30, -1e-30, 88.5, -88.5, 1.0, -1.0, 2.0, 0.5])
    x = torch.cat([gate, torch.full_like(gate, 3.0)])[None]
    got, want = elementwise.silu_and_mul(x)[0], fused._silu_and_mul_torch(x)[0]
    torch.testing.assert_close(got, want, rtol=3e-7, atol=1e-30, equal_nan=True)
    assert got[6] == float("inf") and got[8].isnan() and got[7].isnan()
    for dtype in (torch.bfloat16, torch.float16):
        y = x.to(dtype)
        # bit for bit but below -87, where bfloat16 still holds torch's ~1e-36 and ours is 0
        torch.testing.assert_close(elementwise.silu_and_mul(y), fused._silu_and_mul_torch(y), rtol=0,
                                   atol=1e-30, equal_nan=True)


def test_silu_and_mul_reads_a_strided_row_view_and_no_rows():
    """Rows of a wider tensor (a unit last stride) in place; an empty batch gives an empty result."""
    wide = torch.randn(5, 300, generator=_gen(12)).to(torch.bfloat16)
    x = wide[:, :256]
    assert torch.equal(elementwise.silu_and_mul(x), fused._silu_and_mul_torch(x.contiguous()))
    assert elementwise.silu_and_mul(torch.empty(0, 64)).shape == (0, 32)


def test_silu_and_mul_refuses_what_it_cannot_take():
    with pytest.raises(RuntimeError, match=r"must be a CPU \[T, 2 I\] tensor"):
        elementwise.silu_and_mul(torch.randn(64))
    with pytest.raises(RuntimeError, match=r"must be a CPU \[T, 2 I\] tensor"):
        elementwise.silu_and_mul(torch.randn(2, 63))
    with pytest.raises(RuntimeError, match=r"must be a CPU \[T, 2 I\] tensor"):
        elementwise.silu_and_mul(torch.randn(64, 2).t())
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16 only"):
        elementwise.silu_and_mul(torch.randn(2, 8, dtype=torch.float64))
    assert not elementwise.silu_and_mul_supported(torch.randn(2, 63))
    assert not elementwise.silu_and_mul_supported(torch.randn(2, 3, 8))
    assert elementwise.silu_and_mul_supported(torch.randn(2, 8, dtype=torch.bfloat16))


def test_kernels_silu_and_mul_routes_cpu_tensors_to_the_extension(monkeypatch):
    """``kernels.fused.silu_and_mul`` answers from the extension by default and from torch with the
    switch off (or a tensor outside the op's contract); the answers agree."""
    x = torch.randn(3, 128, generator=_gen(13)).to(torch.bfloat16)
    calls = []
    real = elementwise.silu_and_mul
    monkeypatch.setattr(elementwise, "silu_and_mul", lambda *a: calls.append(1) or real(*a))
    on = fused.silu_and_mul(x)
    fused.silu_and_mul(x[None])  # [1, T, 2I]: not the op's shape, the torch path
    monkeypatch.setenv(decode.ENV, "0")
    off = fused.silu_and_mul(x)
    assert calls == [1]
    assert torch.equal(on, off)


# -- gemv ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])  # four output rows at a time up to 4, two above
# 4: one block, the prefetch clamped to it; 67: a tail past the four-row blocks
@pytest.mark.parametrize("out_features", [4, 67, 256])
def test_gemv_against_float64(dtype, rows, out_features):
    g = _gen(8)
    w = torch.randn(out_features, 96, generator=g).to(dtype)
    x = torch.randn(rows, 96, generator=g).to(dtype)
    bias = torch.randn(out_features, generator=g).to(dtype)
    exact = x.double() @ w.double().T  # [rows, N]
    got = gemv.linear(x, w)
    assert got.dtype == dtype and got.shape == (rows, out_features)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.double(), exact.to(dtype).double(), rtol=tol, atol=tol)
    # the bias joins after the product is rounded, as torch's ``linear(x, w) + bias`` in the dtype
    assert torch.equal(gemv.linear(x, w, bias), got + bias)


def test_gemv_reads_every_float16_value_exactly():
    """All 65,536 float16 bit patterns as the first column of a weight, times a one-hot row: the
    vectorised half-to-float conversion gives each value exactly (subnormals, infinities, NaNs)."""
    values = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16)
    w = torch.zeros(65536, 16, dtype=torch.float16)
    w[:, 0] = values
    x = torch.zeros(1, 16)
    x[0, 0] = 1.0
    got, want = gemv.linear(x, w)[0], values.float()  # float32 out: nothing rounded after the product
    assert bool(((got == want) | (got.isnan() & want.isnan())).all())


def test_gemv_splits_rows_over_threads_with_the_same_answer():
    g = _gen(9)
    w = torch.randn(1000, 64, generator=g).to(torch.bfloat16)
    x = torch.randn(2, 64, generator=g).to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gemv.linear(x, w)
        torch.set_num_threads(2)
        two = gemv.linear(x, w)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)  # each output's sum is one thread's, in one order


def test_gemv_refuses_what_it_cannot_take():
    w = torch.randn(8, 32, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="1 to 8 rows, got 9"):
        gemv.linear(torch.randn(9, 32, dtype=torch.bfloat16), w)
    with pytest.raises(RuntimeError, match="multiple of 16, got 24"):
        gemv.linear(torch.randn(1, 24, dtype=torch.bfloat16), torch.randn(8, 24, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="x has 16 features, the weight 32"):
        gemv.linear(torch.randn(1, 16, dtype=torch.bfloat16), w)
    assert not gemv.supports(torch.randn(9, 32, dtype=torch.bfloat16), w)
    float64 = torch.randn(8, 32, dtype=torch.float64)
    assert not gemv.supports(torch.randn(1, 32, dtype=torch.float64), float64)  # float64 stays on torch
    assert gemv.supports(torch.randn(8, 32, dtype=torch.bfloat16), w)
    half = torch.randn(8, 32, dtype=torch.float16)  # one row of float16 weights: torch's is faster
    assert not gemv.supports(torch.randn(1, 32, dtype=torch.float16), half)
    assert gemv.supports(torch.randn(2, 32, dtype=torch.float16), half)


needs_int8 = pytest.mark.skipif(not gemv.int8_runs(), reason="the int8 GEMV needs AVX-512")


@needs_int8
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("out_features", [4, 67, 256])
def test_gemv_int8_against_float64_and_torchs_kernel(rows, out_features):
    g = _gen(9)
    q = torch.randint(-127, 128, (out_features, 96), generator=g, dtype=torch.int8)
    scales = (torch.rand(out_features, generator=g) / 50).to(torch.bfloat16)
    x = torch.randn(rows, 96, generator=g).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=g).to(torch.bfloat16)
    got = gemv.linear_int8(x, q, scales)
    exact = (x.double() @ q.double().T) * scales.double()  # [rows, N]
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    torch.testing.assert_close(got.double(), exact.to(torch.bfloat16).double(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got, torch._weight_int8pack_mm(x, q, scales), rtol=1e-2, atol=1e-2)
    assert torch.equal(gemv.linear_int8(x, q, scales, bias), got + bias)  # the bias after the rounding


@needs_int8
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize(("out_features", "in_features"), [(5, 48), (67, 4096), (9, 4096 + 80)])
def test_gemv_int8_sums_of_integers_are_exact_on_both_kernels(rows, out_features, in_features):
    """Activations that are integers below 2^7 are exact in the VNNI kernel's 16-bit units, and their
    sums with int8 codes are integers below 2^24: both kernels (int16 activations with int32 sums where
    VNNI runs, float32 otherwise) must give the exact result, rounded once to bfloat16. 48 and 4176
    features end on half a 32-code step; 4176 spans two 4096-feature chunks (two units a row)."""
    g = _gen(11)
    q = torch.randint(-128, 128, (out_features, in_features), generator=g, dtype=torch.int8)
    x = torch.randint(-100, 101, (rows, in_features), generator=g).to(torch.bfloat16)
    x[0, -1] = 127  # the second chunk's unit differs from the first's
    scales = torch.ones(out_features, dtype=torch.bfloat16)
    exact = (x.double() @ q.double().T).to(torch.bfloat16)
    library = decode.library()
    if rows > gemv.int8_max_rows():  # 5-8 rows only where VNNI runs
        with pytest.raises(RuntimeError, match=f"1 to 4 rows, got {rows}"):
            library.gemv_int8(x, q, scales, None)
        return
    assert torch.equal(library.gemv_int8(x, q, scales, None), exact)
    if rows <= gemv.INT8_MAX_ROWS:
        assert torch.equal(library.gemv_int8_widened(x, q, scales, None), exact)
    else:  # the float32 kernel stops at 4 rows
        with pytest.raises(RuntimeError, match=f"1 to 4 rows, got {rows}"):
            library.gemv_int8_widened(x, q, scales, None)


@needs_int8
def test_gemv_int8_vnni_activations_keep_their_precision():
    """Where VNNI runs, a float32 activation row goes in as 16-bit integers in units of a power of
    two near its largest magnitude / 2^15: against the float64 product, the error stays within the
    integers' resolution, and a bfloat16 row (8 significant bits) loses nothing (the float32 kernel's
    error is float32 rounding alone). A row holding an infinity goes to the float32 kernel whole."""
    library = decode.library()
    g = _gen(12)
    q = torch.randint(-128, 128, (64, 256), generator=g, dtype=torch.int8)
    scales = torch.ones(64)
    x = torch.randn(2, 256, generator=g)
    x[0, 7] = 40.0  # the row's unit: 2^(6 - 15)
    exact = x.double() @ q.double().T
    got = library.gemv_int8(x, q, scales, None)
    bound = 0.5 * 2.0 ** (6 - 15) * q.double().abs().sum(1)  # half a unit per activation, times |code|
    assert ((got.double() - exact).abs() <= bound + 1e-3 * exact.abs()).all()
    widened = library.gemv_int8_widened(x, q, scales, None).double()
    assert (widened - exact).abs().max() < 1e-6 * exact.abs().max()
    row = x[0].to(torch.bfloat16).clamp(-2.0, 2.0)
    row[7] = 2.0  # the unit 2^(2 - 15): every bfloat16 of magnitude 2^-6 or more is a whole number of it
    row[row.abs() < 2.0 ** -6] = 0.0
    exact = row.double() @ q.double().T
    assert (library.gemv_int8(row.float()[None], q, scales, None)[0].double() - exact).abs().max() < 1e-3
    x[1, 3] = float("inf")
    got = library.gemv_int8(x, q, scales, None)
    assert not torch.isfinite(got[1]).any() and torch.isfinite(got[0]).all()
    assert torch.equal(got.nan_to_num(), library.gemv_int8_widened(x, q, scales, None).nan_to_num())
    if gemv.int8_vnni():  # 6 rows, one of them infinite: the float32 kernel 4 rows at a time
        six = torch.cat([x, torch.randn(4, 256, generator=g)])
        got = library.gemv_int8(six, q, scales, None)
        halves = torch.cat([library.gemv_int8_widened(six[:4], q, scales, None),
                            library.gemv_int8_widened(six[4:], q, scales, None)])
        assert torch.equal(got.nan_to_num(), halves.nan_to_num())


@needs_int8
def test_gemv_int8_refuses_what_it_cannot_take():
    q = torch.zeros(8, 32, dtype=torch.int8)
    scales = torch.ones(8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="1 to 8 rows, got 9"):
        gemv.linear_int8(torch.zeros(9, 32, dtype=torch.bfloat16), q, scales)
    with pytest.raises(RuntimeError, match="1 to 4 rows, got 5"):
        gemv.linear_int8(torch.zeros(5, 32, dtype=torch.bfloat16), q, scales, widen=True)
    with pytest.raises(RuntimeError, match="int8 tensor"):
        gemv.linear_int8(torch.zeros(1, 32, dtype=torch.bfloat16), q.float(), scales)
    with pytest.raises(RuntimeError, match="scales must be a contiguous \\[8\\] tensor"):
        gemv.linear_int8(torch.zeros(1, 32, dtype=torch.bfloat16), q, scales[:4])
    odd = torch.zeros(8, 24, dtype=torch.int8)  # K not a multiple of 16
    assert not gemv.int8_supports(torch.zeros(1, 24, dtype=torch.bfloat16), odd)
    assert gemv.int8_supports(torch.zeros(4, 32, dtype=torch.bfloat16), q)
    assert gemv.int8_supports(torch.zeros(8, 32, dtype=torch.bfloat16), q) == gemv.int8_vnni()
    assert not gemv.int8_supports(torch.zeros(9, 32, dtype=torch.bfloat16), q)


@needs_int8
def test_quantized_int8_linear_takes_the_int8_gemv(monkeypatch):
    """An int8 ``QuantizedLinear`` runs the compiled kernel up to 4 rows (its packed limit), torch's
    dense path above, and torch's packed kernel with the switch off: the same values within a
    rounding."""
    from batchinfer.workers.quant.linear import QuantizedLinear

    linear = nn.Linear(64, 48, bias=True)
    module = QuantizedLinear.from_linear(linear, "int8")
    calls = []
    real = gemv.linear_int8
    monkeypatch.setattr(gemv, "linear_int8", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    x = torch.randn(3, 64).to(torch.bfloat16)
    y = module(x)
    assert calls == [3]
    assert module.packed_max_rows == gemv.int8_max_rows() == (8 if gemv.int8_vnni() else 4)
    module(torch.randn(gemv.int8_max_rows(), 64).to(torch.bfloat16))
    assert calls == [3, gemv.int8_max_rows()]
    module(torch.randn(gemv.int8_max_rows() + 1, 64).to(torch.bfloat16))  # the dense copy
    assert calls == [3, gemv.int8_max_rows()]
    monkeypatch.setenv(decode.ENV, "0")
    off = module(x)
    assert calls == [3, gemv.int8_max_rows()]
    torch.testing.assert_close(y, off, rtol=1e-2, atol=1e-2)


def test_gemv_linear_module(monkeypatch):
    """``GemvLinear`` shares the linear's parameters; up to eight rows go to the GEMV, more (or the
    switch off) to ``nn.Linear``'s path; a leading batch shape is kept."""
    linear = nn.Linear(64, 40, bias=True).to(torch.bfloat16)
    module = GemvLinear.sharing(linear)
    assert module.weight is linear.weight and module.bias is linear.bias
    calls = []
    real = gemv.linear
    monkeypatch.setattr(gemv, "linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    x = torch.randn(1, 3, 64).to(torch.bfloat16)
    y = module(x)
    assert y.shape == (1, 3, 40) and calls == [3]
    torch.testing.assert_close(y.float(), linear(x).float(), rtol=2e-2, atol=2e-2)
    big = torch.randn(9, 64).to(torch.bfloat16)
    assert torch.equal(module(big), linear(big)) and calls == [3]
    monkeypatch.setenv(decode.ENV, "0")
    assert torch.equal(module(x), linear(x)) and calls == [3]


# -- the engine on all three ops -------------------------------------------------------------------

@pytest.mark.timeout(300)
def test_bfloat16_engine_runs_the_extension_and_agrees_with_the_torch_paths(tiny_llama, monkeypatch):
    """A bfloat16 model's projections and (tied or not) head become ``GemvLinear``; greedy decoding
    with the extension gives the tokens and, within bfloat16's rounding, the logprobs of the torch
    paths (the same ``LLM``, the switch flipped between calls)."""
    llm = LLM(str(tiny_llama), dtype="bfloat16", num_kv_blocks=32)
    model = llm.engine.model
    assert all(isinstance(layer.self_attn.qkv_proj, GemvLinear) for layer in model.layers)
    assert isinstance(model.lm_head, GemvLinear)
    prompts = [{"prompt_token_ids": [5, 17, 33, 2, 90, 41]}, {"prompt_token_ids": [7, 7, 8]}]
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=1, ignore_eos=True)
    monkeypatch.setenv(decode.ENV, "auto")
    on = llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.setenv(decode.ENV, "0")
    off = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(on, off, strict=True):
        assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
        for step_a, step_b, token in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids,
                                         strict=True):
            # logits are bfloat16: one unit in the last place is 1/32 to 1/16 at their size here
            assert abs(step_a[token].logprob - step_b[token].logprob) < 0.15

