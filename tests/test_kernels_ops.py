"""Custom-op registration (fake implementations, torch.compile), the flash adapter, and the
split-K/tile choice — all on CPU with the reference backend or pure functions."""

from __future__ import annotations

import pytest
import torch
from paged_batches import dense_reference, make_paged_batch
from torch._subclasses.fake_tensor import FakeTensorMode

from batchinfer import kernels
from batchinfer.kernels import dispatch, flash
from batchinfer.kernels.attention_config import choose_config

MIXED = [(1, 1), (37, 1), (19, 19), (50, 9), (5, 2)]


def test_fake_impls_give_shapes_without_running():
    with FakeTensorMode():
        q = torch.empty(31, 8, 80, dtype=torch.bfloat16)
        cache = torch.empty(100, 16, 2, 80, dtype=torch.bfloat16)
        tables = torch.empty(5, 7, dtype=torch.int32)
        cu, lens = torch.empty(6, dtype=torch.int32), torch.empty(5, dtype=torch.int32)
        out = torch.ops.batchinfer.paged_attention(q, cache, cache, tables, cu, lens, None, 4, "triton")
        assert out.shape == (31, 8, 80) and out.dtype == torch.bfloat16
        k = torch.empty(31, 2, 80, dtype=torch.bfloat16)
        assert torch.ops.batchinfer.write_kv(k, k, cache, cache, torch.empty(31, dtype=torch.int64)) is None
        with pytest.raises(ValueError, match="multiple of num_kv_heads"):
            torch.ops.batchinfer.paged_attention(q[:, :3], cache, cache, tables, cu, lens)


def test_opcheck_paged_attention_and_write_kv():
    batch = make_paged_batch(MIXED, 4, 2, 64, 16)
    torch.library.opcheck(torch.ops.batchinfer.paged_attention.default,
                          (*batch.args(), None, None, "reference"))
    torch.library.opcheck(torch.ops.batchinfer.paged_attention.default,
                          (*batch.args(), 0.2, 8, "reference", 1.5))
    k = torch.randn(3, 2, 64)
    slots = torch.tensor([0, -1, 5])
    torch.library.opcheck(torch.ops.batchinfer.write_kv.default,
                          (k, k.clone(), batch.k_cache.clone(), batch.v_cache.clone(), slots, None))


def test_torch_compile_traces_the_ops_without_graph_breaks():
    batch = make_paged_batch(MIXED, 4, 2, 64, 16)
    new_k = torch.randn(2, 2, 64)
    slots = torch.tensor([batch.block_tables[0, 0].item() * 16, -1])  # overwrite sequence 0's only key

    def step(q, k_cache, v_cache, block_tables, cu, lens):
        kernels.write_kv(new_k, new_k, k_cache, v_cache, slots)
        return kernels.paged_attention(q, k_cache, v_cache, block_tables, cu, lens, sliding_window=8)

    eager_caches = batch.k_cache.clone(), batch.v_cache.clone()
    expected = step(batch.q, *eager_caches, *batch.args()[3:])
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    caches = batch.k_cache.clone(), batch.v_cache.clone()
    out = compiled(batch.q, *caches, *batch.args()[3:])
    torch.testing.assert_close(out, expected)
    assert torch.equal(caches[0], eager_caches[0])  # the mutation happened inside the graph
    torch.testing.assert_close(out[0], new_k[0].repeat_interleave(2, 0))  # a 1-token sequence sees itself


def _documented_flash(q, k_cache, v_cache, *, max_seqlen_q, cu_seqlens_q, max_seqlen_k, softmax_scale,
                      causal, window_size, block_table, seqused_k=None, cu_seqlens_k=None, softcap=0.0):
    """A torch stand-in written from flash_attn_varlen_func's docstring: bottom-right causal mask,
    keys in [i + Lk - Lq - left, i + Lk - Lq + right], paged K/V via block_table."""
    assert causal and (seqused_k is None) != (cu_seqlens_k is None)
    lens = seqused_k if seqused_k is not None else cu_seqlens_k.diff()
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[2]
    for b in range(lens.shape[0]):
        start, end, num_k = cu_seqlens_q[b].item(), cu_seqlens_q[b + 1].item(), lens[b].item()
        assert end - start <= max_seqlen_q and num_k <= max_seqlen_k
        k = k_cache[block_table[b]].flatten(0, 1)[:num_k].repeat_interleave(group, 1)  # [Lk, H, D]
        v = v_cache[block_table[b]].flatten(0, 1)[:num_k].repeat_interleave(group, 1)
        for i in range(end - start):
            centre = i + num_k - (end - start)
            lo = 0 if window_size[0] < 0 else max(0, centre - window_size[0])
            scores = torch.einsum("hd,khd->hk", q[start + i], k[lo:centre + 1]) * softmax_scale
            if softcap > 0:  # flash-attn: softcap 0.0 means off
                scores = softcap * torch.tanh(scores / softcap)
            out[start + i] = torch.einsum("hk,khd->hd", scores.softmax(-1), v[lo:centre + 1])
    return out


@pytest.mark.parametrize("takes_seqused_k", [True, False])  # vLLM's newer API / the 2.6 releases
@pytest.mark.parametrize("window", [None, 5])
def test_flash_adapter_translates_the_contract(monkeypatch, takes_seqused_k, window):
    if takes_seqused_k:
        func = _documented_flash
    else:
        def func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                 causal=False, window_size=(-1, -1), block_table=None):
            return _documented_flash(
                q, k, v, max_seqlen_q=max_seqlen_q, cu_seqlens_q=cu_seqlens_q, max_seqlen_k=max_seqlen_k,
                softmax_scale=softmax_scale, causal=causal, window_size=window_size, block_table=block_table,
                cu_seqlens_k=cu_seqlens_k)
    provider = flash.FlashProvider("stand_in", 16, func, takes_seqused_k)
    monkeypatch.setattr(flash, "_probe", lambda: provider)
    batch = make_paged_batch(MIXED, 8, 2, 64, 16)
    out = flash.paged_attention(*batch.args(), scale=0.125, sliding_window=window)
    torch.testing.assert_close(out, dense_reference(batch, scale=0.125, sliding_window=window),
                               atol=2e-5, rtol=2e-5)


def test_flash_adapter_passes_softcap(monkeypatch):
    provider = flash.FlashProvider("stand_in", 16, _documented_flash, True, True)
    monkeypatch.setattr(flash, "_probe", lambda: provider)
    assert flash.supports_softcap()
    batch = make_paged_batch(MIXED, 8, 2, 64, 16)
    out = flash.paged_attention(*batch.args(), scale=0.125, sliding_window=5, softcap=0.9)
    torch.testing.assert_close(out, dense_reference(batch, scale=0.125, sliding_window=5, softcap=0.9),
                               atol=2e-5, rtol=2e-5)


def test_flash_without_softcap_refuses_by_name_and_falls_back_automatically(monkeypatch):
    def no_softcap(q, k, v, *, max_seqlen_q, cu_seqlens_q, max_seqlen_k, softmax_scale, causal, window_size,
                   block_table, seqused_k=None):
        raise AssertionError("a soft-capped call must never reach a provider without softcap")

    provider = flash.FlashProvider("old_flash", 16, no_softcap, True, False)
    monkeypatch.setattr(flash, "_probe", lambda: provider)
    assert not flash.supports_softcap()
    batch = make_paged_batch(MIXED, 8, 2, 64, 16)
    with pytest.raises(RuntimeError, match="old_flash.flash_attn_varlen_func takes no softcap"):
        flash.paged_attention(*batch.args(), softcap=1.0)
    with pytest.raises(RuntimeError, match="'flash' is unavailable: .*no softcap"):
        dispatch._flash_or_fallback("flash", torch.device("cpu"), torch.bfloat16)
    # Chosen automatically, flash gives way to the next backend (reference here: Triton needs CUDA
    # unless interpreting, and the interpreter is never an automatic choice on CPU).
    assert dispatch._flash_or_fallback(None, torch.device("cpu"), torch.bfloat16) in ("triton", "reference")


def test_flash_availability_reasons(monkeypatch):
    cuda = torch.device("cuda")
    assert "needs CUDA" in flash.unavailable_reason(torch.device("cpu"))
    provider = flash.FlashProvider("vllm_flash_attn", 16, _documented_flash, True)
    monkeypatch.setattr(flash, "_probe", lambda: provider)
    assert flash.unavailable_reason(cuda, torch.bfloat16, 16, 128) is None
    assert "float16/bfloat16" in flash.unavailable_reason(cuda, torch.float32, 16, 128)
    assert "multiple of 16, not 8" in flash.unavailable_reason(cuda, torch.bfloat16, 8, 128)
    assert "head dim" in flash.unavailable_reason(cuda, torch.bfloat16, 16, 84)
    upstream = flash.FlashProvider("flash_attn", 256, _documented_flash, False)
    monkeypatch.setattr(flash, "_probe", lambda: upstream)
    assert "multiple of 256, not 16" in flash.unavailable_reason(cuda, torch.bfloat16, 16, 128)


def test_flash_probe_lists_what_it_tried():
    reason = flash._probe()
    if not isinstance(reason, str):
        pytest.skip(f"a flash provider is installed here: {reason.module}")
    assert "vllm_flash_attn" in reason and "flash_attn" in reason


def test_window_size_convention():
    assert flash.window_size(None) == (-1, -1)
    assert flash.window_size(1) == (0, 0)  # only the query's own key
    assert flash.window_size(4096) == (4095, 0)


def test_unknown_backend_names_the_choices():
    with pytest.raises(ValueError, match="expected one of flash, triton, reference"):
        dispatch.unavailable_reason("fast", "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_cuda_backends_need_cuda():
    assert kernels.available_backends("cuda") == ["reference"]
    assert "CUDA is not available" in dispatch.unavailable_reason("triton", "cuda")


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "needs CUDA tensors" in dispatch.unavailable_reason("triton", "cpu")
    assert dispatch.available_backends("cpu") == ["cpu", "reference"]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dispatch.available_backends("cpu") == ["cpu", "triton", "reference"]
    assert dispatch.select_backend(None, torch.device("cpu")) == "cpu"  # the interpreter is never picked


def test_decode_config_splits_only_small_batches_with_long_contexts():
    small_long = choose_config(4, 4, 32, 8, 8192, num_sms=132)
    assert small_long.num_splits > 1 and small_long.block_q == 1
    assert choose_config(256, 256, 32, 8, 8192, num_sms=132).num_splits == 1  # enough programs already
    assert choose_config(4, 4, 32, 8, 128, num_sms=132).num_splits == 1  # short contexts: no split
    assert choose_config(4, 4, 32, 8, 8192, num_sms=0).num_splits == 1  # unknown device
    for cfg in (small_long, choose_config(1, 1, 64, 1, 1 << 17, num_sms=132)):
        assert cfg.num_splits & (cfg.num_splits - 1) == 0  # a power of 2 (the merge kernel's arange)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(32, 8), (28, 4), (64, 1), (8, 8)])
def test_prefill_config_holds_whole_head_groups(num_heads, num_kv_heads):
    group = num_heads // num_kv_heads
    for tokens in (100, 5000):
        cfg = choose_config(tokens, 3, num_heads, num_kv_heads, 8192, num_sms=132)
        assert cfg.block_q >= 1 and cfg.block_q * group <= cfg.block_m and cfg.num_splits == 1
