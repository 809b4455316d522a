"""The torch dequantizers against gguf's own numpy reference, type by type, value for value.

Types gguf can quantize get real quantized data; the K-quants (gguf has no quantizer for them)
get random block bytes whose fp16 scale fields are set to small finite values. The dequantizers
do gguf's float32 operations in gguf's order, so the values must be bit-identical.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from batchinfer.workers.models.gguf.dequant import SUPPORTED_TYPES, dequantize_bytes  # noqa: E402

Q = gguf.GGMLQuantizationType
QUANTIZABLE = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]
# Byte offsets of each block's fp16 fields (d, and dmin where there is one).
FP16_FIELDS = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
               Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,)}
K_QUANTS = [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]
BLOCK_TYPES = [*FP16_FIELDS]
SHAPE = (6, 512)  # rows x columns: 512 columns = 2 K-blocks or 16 small blocks per row
# Over a million values: two CPU slices of the dequantizer (2^20 values, the last one partial), and an
# output large enough to be advised onto huge pages.
LARGE = (2050, 512)


def _random_blocks(qtype, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    for off in FP16_FIELDS[qtype]:
        scales = rng.uniform(-0.05, 0.05, size=raw.shape[0]).astype(np.float16)
        raw[:, off:off + 2] = scales.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, cols // block * size)


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
def test_quantized_data_matches_gguf(qtype):
    x = np.random.default_rng(1).standard_normal(SHAPE).astype(np.float32)
    data = gguf.quants.quantize(x, qtype)
    expected = gguf.quants.dequantize(data, qtype)
    got = dequantize_bytes(data, qtype, SHAPE)
    assert got.dtype == torch.float32 and tuple(got.shape) == SHAPE
    torch.testing.assert_close(got, torch.from_numpy(np.asarray(expected, dtype=np.float32)),
                               rtol=0, atol=0)
    if qtype not in (Q.F32, Q.F16, Q.BF16):  # a real round trip: close to the input
        assert (got - torch.from_numpy(x)).abs().max() < 0.5


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: t.name)
def test_k_quant_blocks_match_gguf(qtype):
    raw = _random_blocks(qtype, *SHAPE)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32))
    got = dequantize_bytes(raw, qtype, SHAPE)
    assert tuple(got.shape) == SHAPE and torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_large_tensor_in_slices_matches_gguf(qtype):
    # Random bytes also exercise codes the quantizer never emits (every 4/5/6-bit value).
    raw = _random_blocks(qtype, *LARGE, seed=5)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32))
    got = dequantize_bytes(raw, qtype, LARGE)
    assert tuple(got.shape) == LARGE and got.is_contiguous()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_single_block_matches_gguf(qtype):
    # One block: its fields sit at their in-block offsets, not at word-aligned ones.
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    raw = _random_blocks(qtype, 1, block, seed=7)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32)).view(block)
    torch.testing.assert_close(dequantize_bytes(raw, qtype, (block,)), expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_engine_dtype_is_the_float32_value_rounded_once(qtype, dtype):
    raw = _random_blocks(qtype, *LARGE, seed=6)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32)).to(dtype)
    got = dequantize_bytes(raw, qtype, LARGE, dtype=dtype)
    assert got.dtype == dtype
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_q8_k_is_scale_times_int8():
    # Q8_K (an intermediate type of llama.cpp, no numpy reference): f32 d, 256 int8, 16 int16 sums.
    rng = np.random.default_rng(3)
    n = 4
    d = rng.uniform(0.01, 0.1, size=(n, 1)).astype(np.float32)
    qs = rng.integers(-128, 128, size=(n, 256), dtype=np.int8)
    raw = np.concatenate([d.view(np.uint8), qs.view(np.uint8), np.zeros((n, 32), np.uint8)], axis=1)
    got = dequantize_bytes(raw, Q.Q8_K, (n, 256))
    torch.testing.assert_close(got, torch.from_numpy(d * qs.astype(np.float32)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_output_dtype_and_1d_shape(dtype):
    x = np.linspace(-1, 1, 64, dtype=np.float32)
    data = gguf.quants.quantize(x, Q.Q8_0)
    got = dequantize_bytes(data, Q.Q8_0, (64,), dtype=dtype)
    assert got.dtype == dtype and tuple(got.shape) == (64,)
    expected = torch.from_numpy(gguf.quants.dequantize(data, Q.Q8_0)).to(dtype)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_unsupported_type_names_type_and_tensor():
    match = r"blk\.0\.attn_q\.weight: GGUF tensor type IQ2_XXS is not supported"
    with pytest.raises(ValueError, match=match):
        dequantize_bytes(np.zeros(66, np.uint8), Q.IQ2_XXS, (256,), name="blk.0.attn_q.weight")
    with pytest.raises(ValueError, match="unknown GGUF tensor type 9999"):
        dequantize_bytes(np.zeros(4, np.uint8), 9999, (1,), name="x")


def test_byte_count_mismatch_is_an_error():
    with pytest.raises(ValueError, match=r"w: 36 bytes of Q8_0 do not hold shape \(3, 32\)"):
        dequantize_bytes(np.zeros(36, np.uint8), Q.Q8_0, (3, 32), name="w")


def test_supported_types_cover_the_issue():
    for name in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                 "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"):
        assert name in SUPPORTED_TYPES


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_dequantizes_on_the_gpu(qtype):
    raw = _random_blocks(qtype, *SHAPE)
    got = dequantize_bytes(raw, qtype, SHAPE, device="cuda")
    assert got.is_cuda
    expected = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32))
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-6, atol=1e-6)  # GPU may fuse mul+add
