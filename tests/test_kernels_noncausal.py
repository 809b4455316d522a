"""``causal=False`` on every attention backend, and ``varlen_attention`` (packed sequences, no cache).

Ground truth is ``tests/paged_batches.py``'s naive dense attention (float64, ``tril``/``triu`` masks);
the cpu and triton backends are also held to the reference. Without CUDA the Triton kernels run
under the interpreter (``TRITON_INTERPRET=1``, tiny shapes, as tests/test_kernels_triton.py
explains); with CUDA the same tests run compiled, and the ``gpu`` tests add realistic shapes.
"""

from __future__ import annotations

import pytest
import torch
from paged_batches import (
    dense_attention,
    dense_reference,
    dense_varlen,
    make_packed,
    make_paged_batch,
)
from triton_setup import DEVICE  # first: it checks triton is not imported yet

from batchinfer import kernels
from batchinfer.kernels import cpu_attention, dispatch, flash
from batchinfer.kernels.attention_config import AttentionConfig

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
# (context length incl. queries, queries): a lone token, a decode, whole prompts, a chunk over a
# cached prefix, a sequence with no queries this step.
MIXED = [(1, 1), (37, 1), (19, 19), (50, 9), (5, 2), (24, 0), (33, 33)]
LENGTHS = [1, 17, 5, 40, 1, 0, 23]  # packed sequences, one of them empty


def _triton():
    pytest.importorskip("triton")
    from batchinfer.kernels import triton_attention

    return triton_attention


def test_dense_attention_non_causal_is_plain_softmax_attention():
    """The ground truth itself, against softmax(q k^T) v written out with einsum (GQA: 4 heads on 2)."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(3, 4, 8, generator=gen)
    k, v = torch.randn(7, 2, 8, generator=gen), torch.randn(7, 2, 8, generator=gen)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    probs = (torch.einsum("qhd,khd->hqk", q, kk) * 8**-0.5).softmax(-1)
    want = torch.einsum("hqk,khd->qhd", probs, vv)
    torch.testing.assert_close(dense_attention(q, k, v, causal=False), want)
    # A window of W around query p (at position 4 + i): keys |p - k| < W only.
    got = dense_attention(q, k, v, sliding_window=2, causal=False)
    scores = torch.einsum("qhd,khd->hqk", q, kk) * 8**-0.5
    pos = torch.arange(4, 7)[:, None] - torch.arange(7)[None, :]
    want = torch.einsum("hqk,khd->qhd", scores.masked_fill(pos.abs() >= 2, float("-inf")).softmax(-1), vv)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("window,softcap", [(None, None), (6, None), (None, 1.5), (4, 0.7)])
def test_reference_non_causal_matches_dense(num_heads, num_kv_heads, window, softcap):
    batch = make_paged_batch(MIXED, num_heads, num_kv_heads, 16, 8)
    out = kernels.paged_attention(*batch.args(), sliding_window=window, softcap=softcap, causal=False,
                                  backend="reference")
    want = dense_reference(batch, sliding_window=window, softcap=softcap, causal=False)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_causal_flag_changes_prefill_but_not_decode_rows():
    batch = make_paged_batch(MIXED, 4, 2, 16, 8)
    cu = batch.cu_seqlens_q.tolist()
    causal = kernels.paged_attention(*batch.args(), backend="reference")
    full = kernels.paged_attention(*batch.args(), causal=False, backend="reference")
    decode_rows = [cu[i] for i in range(len(MIXED)) if cu[i + 1] - cu[i] == 1]
    # a query at its sequence's last position sees every key either way
    torch.testing.assert_close(full[decode_rows], causal[decode_rows])
    chunk = slice(cu[2], cu[3])  # the 19-token prompt: its early queries now see later keys
    assert (full[chunk] - causal[chunk]).abs().max() > 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("window,softcap", [(None, None), (7, None), (None, 1.5), (5, 0.9)])
def test_cpu_non_causal_matches_reference(monkeypatch, dtype, window, softcap):
    monkeypatch.setattr(cpu_attention, "PREFILL_CHUNK", 8)  # several query chunks per prompt
    batch = make_paged_batch(MIXED, 8, 2, 16, 4, dtype)
    out = kernels.paged_attention(*batch.args(), sliding_window=window, softcap=softcap, causal=False,
                                  backend="cpu")
    ref = kernels.paged_attention(*batch.args(), sliding_window=window, softcap=softcap, causal=False,
                                  backend="reference")
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), **TOL.get(dtype, TOL[torch.float32]))
    want = dense_reference(batch, sliding_window=window, softcap=softcap, causal=False)
    torch.testing.assert_close(out.float(), want, **TOL.get(dtype, TOL[torch.float32]))


# Interpreter-sized: several key tiles (tile_n=16), prefill tiles of several queries, split-K on a
# decode batch, windows, softcap, GQA 1/4, bf16.
TRITON_CASES = [
    # seqs, heads, kv_heads, dtype, window, softcap, config
    (MIXED, 4, 4, torch.float32, None, None, AttentionConfig(16, 4, 16, 1)),
    (MIXED, 8, 2, torch.float32, 6, None, AttentionConfig(16, 4, 16, 1)),
    (MIXED, 8, 2, torch.bfloat16, None, 1.5, None),
    ([(40, 1), (3, 1), (70, 1)], 8, 2, torch.float32, 9, 0.8, AttentionConfig(16, 1, 16, 4)),
]


@pytest.mark.parametrize("seqs,num_heads,num_kv_heads,dtype,window,softcap,config", TRITON_CASES)
def test_triton_non_causal_matches_reference(seqs, num_heads, num_kv_heads, dtype, window, softcap, config):
    triton_attention = _triton()
    batch = make_paged_batch(seqs, num_heads, num_kv_heads, 32, 16, dtype, DEVICE)
    out = triton_attention.paged_attention(*batch.args(), sliding_window=window, softcap=softcap,
                                           causal=False, config=config)
    want = dense_reference(batch, sliding_window=window, softcap=softcap, causal=False).to(DEVICE)
    torch.testing.assert_close(out.float(), want, **TOL[dtype])
    ref = kernels.paged_attention(*batch.args(), sliding_window=window, softcap=softcap, causal=False,
                                  backend="reference")
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_matches_per_sequence_dense(backend, causal):
    if backend == "triton":
        _triton()
    elif DEVICE == "cuda" and backend == "cpu":
        pytest.skip("the cpu backend takes CPU tensors")
    q, k, v, cu = make_packed(LENGTHS, 8, 2, 32, device=DEVICE if backend != "cpu" else "cpu")
    out = kernels.varlen_attention(q, k, v, cu, causal=causal, backend=backend)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.float().cpu(), dense_varlen(q.cpu(), k.cpu(), v.cpu(), cu.cpu(), causal),
                               **TOL[torch.float32])


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
@pytest.mark.parametrize("causal,window,softcap,scale", [(False, 5, None, None), (False, None, 1.2, 0.3),
                                                         (True, 4, 0.9, None)])
def test_varlen_window_softcap_scale(backend, causal, window, softcap, scale):
    if backend == "triton":
        _triton()
    device = "cpu" if backend == "cpu" else DEVICE
    q, k, v, cu = make_packed([9, 1, 30, 12], 4, 1, 16, device=device)
    out = kernels.varlen_attention(q, k, v, cu, causal=causal, scale=scale, sliding_window=window,
                                   softcap=softcap, backend=backend)
    want = dense_varlen(q.cpu(), k.cpu(), v.cpu(), cu.cpu(), causal, scale, window, softcap)
    torch.testing.assert_close(out.cpu(), want, **TOL[torch.float32])


def test_varlen_default_backend_bf16_and_int64_offsets():
    q, k, v, cu = make_packed([3, 64, 1, 130], 12, 12, 32, torch.bfloat16)
    out = kernels.varlen_attention(q, k, v, cu.long(), causal=False)  # cpu, chosen automatically
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), dense_varlen(q, k, v, cu, False), **TOL[torch.bfloat16])
    ref = kernels.varlen_attention(q, k, v, cu, causal=False, backend="reference")
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=1e-2)


def test_varlen_empty_inputs():
    q, k, v, cu = make_packed([], 4, 2, 16)
    assert kernels.varlen_attention(q, k, v, cu, causal=False).shape == (0, 4, 16)
    q, k, v, cu = make_packed([0, 0], 4, 2, 16)
    assert kernels.varlen_attention(q, k, v, cu, causal=True).shape == (0, 4, 16)


def test_varlen_layout_is_a_zero_copy_paged_cache():
    q, k, v, cu = make_packed([3, 2], 4, 2, 16)
    k_cache, v_cache, tables, lens = dispatch.varlen_as_paged(k, v, cu, 3)
    assert k_cache.shape == (5, 1, 2, 16) and k_cache.data_ptr() == k.data_ptr()
    assert v_cache.data_ptr() == v.data_ptr()
    assert tables.tolist() == [[0, 1, 2], [3, 4, 4]] and lens.tolist() == [3, 2]


def _bad(**changes):
    q, k, v, cu = make_packed([3, 4], 4, 2, 16)
    args = dict(q=q, k=k, v=v, cu_seqlens=cu, causal=False) | changes
    return args


@pytest.mark.parametrize("changes,match", [
    (dict(q=torch.randn(7, 64)), "q must be"),
    (dict(k=torch.randn(6, 2, 16)), "k and v must both be"),
    (dict(v=torch.randn(7, 2, 8)), "k and v must both be"),
    (dict(k=torch.randn(7, 3, 16), v=torch.randn(7, 3, 16)), "multiple of num_kv_heads"),
    (dict(cu_seqlens=torch.tensor([0.0, 3.0, 7.0])), "cu_seqlens must be a 1-D int32"),
    (dict(cu_seqlens=torch.tensor([[0, 3, 7]], dtype=torch.int32)), "cu_seqlens must be a 1-D int32"),
    (dict(cu_seqlens=torch.tensor([1, 3, 7], dtype=torch.int32)), "run from 0 to num_tokens=7"),
    (dict(cu_seqlens=torch.tensor([0, 3, 6], dtype=torch.int32)), "run from 0 to num_tokens=7"),
    (dict(cu_seqlens=torch.tensor([0, 5, 3, 7], dtype=torch.int32)), r"not decrease.*cu_seqlens\[1:3\]"),
    (dict(v=torch.randn(7, 2, 16, dtype=torch.float64)), "share a dtype"),
    (dict(sliding_window=0), "sliding_window must be >= 1"),
    (dict(softcap=0.0), "softcap must be > 0"),
    (dict(softcap=float("nan")), "softcap must be > 0"),
])
def test_varlen_bad_input_errors(changes, match):
    with pytest.raises(ValueError, match=match):
        kernels.varlen_attention(**_bad(**changes))


def test_varlen_needs_causal_by_keyword_and_refuses_flash_clearly():
    q, k, v, cu = make_packed([3, 4], 4, 2, 16)
    with pytest.raises(TypeError):
        kernels.varlen_attention(q, k, v, cu)  # causal has no default: the caller must say which
    with pytest.raises(TypeError):
        kernels.varlen_attention(q, k, v, cu, False)  # keyword-only
    with pytest.raises(RuntimeError, match="one-token blocks: attention backend 'flash' is unavailable"):
        kernels.varlen_attention(q, k, v, cu, causal=False, backend="flash")


def test_paged_non_causal_refuses_a_bad_window():
    batch = make_paged_batch(MIXED, 4, 2, 16, 8)
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        kernels.paged_attention(*batch.args(), sliding_window=0, causal=False)


def test_custom_ops_take_causal_and_varlen():
    batch = make_paged_batch(MIXED, 4, 2, 16, 8)
    torch.library.opcheck(torch.ops.batchinfer.paged_attention.default,
                          (*batch.args(), None, 4, "reference", 1.5, False))
    q, k, v, cu = make_packed([3, 1, 6], 4, 2, 16)
    torch.library.opcheck(torch.ops.batchinfer.varlen_attention.default,
                          (q, k, v, cu, False, None, 2, None, None))


def test_torch_compile_traces_varlen_without_graph_breaks():
    q, k, v, cu = make_packed([3, 1, 6], 4, 2, 16)

    def layer(q, k, v, cu):
        return kernels.varlen_attention(q * 2, k, v, cu, causal=False) + 1

    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v, cu), layer(q, k, v, cu))


def _documented_flash(q, k_cache, v_cache, *, max_seqlen_q, cu_seqlens_q, max_seqlen_k, softmax_scale,
                      causal, window_size, block_table, seqused_k, softcap=0.0):
    """A torch stand-in written from flash_attn_varlen_func's docstring: query i of a sequence sees
    keys in [i + Lk - Lq - left, i + Lk - Lq + right] (right = 0 when causal; -1 = unbounded)."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[2]
    for b in range(seqused_k.shape[0]):
        start, end, num_k = cu_seqlens_q[b].item(), cu_seqlens_q[b + 1].item(), seqused_k[b].item()
        k = k_cache[block_table[b]].flatten(0, 1)[:num_k].repeat_interleave(group, 1)  # [Lk, H, D]
        v = v_cache[block_table[b]].flatten(0, 1)[:num_k].repeat_interleave(group, 1)
        left, right = window_size
        right = 0 if causal else right
        for i in range(end - start):
            centre = i + num_k - (end - start)
            lo = 0 if left < 0 else max(0, centre - left)
            hi = num_k if right < 0 else min(num_k, centre + right + 1)
            scores = torch.einsum("hd,khd->hk", q[start + i], k[lo:hi]) * softmax_scale
            if softcap > 0:
                scores = softcap * torch.tanh(scores / softcap)
            out[start + i] = torch.einsum("hk,khd->hd", scores.softmax(-1), v[lo:hi])
    return out


@pytest.mark.parametrize("window", [None, 5])
def test_flash_adapter_passes_causal_and_a_symmetric_window(monkeypatch, window):
    assert flash.window_size(5, causal=False) == (4, 4) and flash.window_size(5) == (4, 0)
    provider = flash.FlashProvider("stand_in", 16, _documented_flash, True, True)
    monkeypatch.setattr(flash, "_probe", lambda: provider)
    batch = make_paged_batch(MIXED, 8, 2, 64, 16)
    out = flash.paged_attention(*batch.args(), scale=0.125, sliding_window=window, softcap=1.1, causal=False)
    want = dense_reference(batch, scale=0.125, sliding_window=window, softcap=1.1, causal=False)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)


def test_varlen_cpu_bench_checks_its_peers_and_prints_the_table(capsys):
    from bench_scripts import bench_script

    with bench_script("varlen_cpu") as bench:
        assert bench.main(["--seqs", "5", "--iters", "1"]) == 0  # asserts varlen == padded SDPA first
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("== varlen_cpu: 5 texts")
    assert [line.split("  ")[0] for line in lines[2:4]] == ["varlen_attention (cpu, causal=False)",
                                                            "varlen_attention (cpu, causal=True)"]


# --- compiled kernels on a real GPU -------------------------------------------------------------

GPU_SEQS = [(1, 1), (300, 300), (2048, 512), (130, 130), (777, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 128])
def test_gpu_triton_non_causal_matches_reference(window):
    batch = make_paged_batch(GPU_SEQS, 32, 8, 128, 16, torch.bfloat16, "cuda")
    ref = kernels.paged_attention(*batch.args(), sliding_window=window, causal=False, backend="reference")
    out = kernels.paged_attention(*batch.args(), sliding_window=window, causal=False, backend="triton")
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_varlen_bert_shapes_match_reference(causal):
    gen = torch.Generator().manual_seed(7)
    lengths = torch.randint(8, 257, (64,), generator=gen).tolist()  # a BERT step: 64 texts of 8-256 tokens
    q, k, v, cu = make_packed(lengths, 12, 12, 32, torch.bfloat16, "cuda", gen)
    out = kernels.varlen_attention(q, k, v, cu, causal=causal)  # triton, chosen automatically
    ref = kernels.varlen_attention(q, k, v, cu, causal=causal, backend="reference")
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
