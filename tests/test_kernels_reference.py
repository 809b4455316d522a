"""The reference backend (the specification) against a naive dense attention built from the
same K/V, plus ``write_kv``, input checks and backend selection. Pure torch, CPU."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from paged_batches import dense_reference, make_paged_batch

from batchinfer import kernels
from batchinfer.kernels import reference

# (context length incl. queries, queries): a 1-token sequence, decodes, a whole prompt whose length
# is not a multiple of any block size, prefix-cached prefill chunks, a sequence with no queries.
MIXED = [(1, 1), (37, 1), (19, 19), (70, 9), (33, 32), (64, 0), (5, 2)]
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (16, 2)])  # GQA 1, 4, 8
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
def test_reference_matches_dense(head_dim, num_heads, num_kv_heads, block_size, dtype):
    batch = make_paged_batch(MIXED, num_heads, num_kv_heads, head_dim, block_size, dtype)
    out = kernels.paged_attention(*batch.args(), backend="reference")
    assert out.shape == batch.q.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), dense_reference(batch), **TOL[dtype])


@pytest.mark.parametrize("window", [1, 4, 16, 33, 1000])
@pytest.mark.parametrize("block_size", [16, 32])
def test_reference_sliding_window(window, block_size):
    batch = make_paged_batch(MIXED, 8, 2, 64, block_size)
    out = kernels.paged_attention(*batch.args(), sliding_window=window, backend="reference")
    torch.testing.assert_close(out, dense_reference(batch, sliding_window=window), **TOL[torch.float32])


def test_window_of_one_returns_each_tokens_own_value():
    batch = make_paged_batch([(9, 4)], 2, 1, 64, 16)
    out = kernels.paged_attention(*batch.args(), sliding_window=1, backend="reference")
    expected = batch.values[0][-4:].expand(4, 2, 64)  # each query sees only its own key
    torch.testing.assert_close(out, expected)


def test_scale_is_applied():
    batch = make_paged_batch(MIXED, 4, 2, 64, 16)
    out = kernels.paged_attention(*batch.args(), scale=0.3, backend="reference")
    torch.testing.assert_close(out, dense_reference(batch, scale=0.3), **TOL[torch.float32])
    default = kernels.paged_attention(*batch.args(), backend="reference")
    assert not torch.allclose(out, default)


@pytest.mark.parametrize("softcap,window", [(1.5, None), (0.7, 16), (50.0, None)])
def test_reference_softcap(softcap, window):
    """Gemma 2's attention-logit soft-capping: cap * tanh(scaled score / cap) before the mask."""
    batch = make_paged_batch(MIXED, 8, 2, 64, 16)
    out = kernels.paged_attention(*batch.args(), sliding_window=window, softcap=softcap, scale=0.3,
                                  backend="reference")
    expected = dense_reference(batch, scale=0.3, sliding_window=window, softcap=softcap)
    torch.testing.assert_close(out, expected, **TOL[torch.float32])
    uncapped = kernels.paged_attention(*batch.args(), sliding_window=window, scale=0.3, backend="reference")
    assert softcap > 10 or not torch.allclose(out, uncapped, atol=1e-3)  # a small cap changes the result


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan")])
def test_softcap_must_be_positive(bad):
    batch = make_paged_batch(MIXED, 4, 2, 64, 16)
    with pytest.raises(ValueError, match="softcap must be > 0"):
        kernels.paged_attention(*batch.args(), softcap=bad, backend="reference")


@settings(max_examples=20, deadline=None)
@given(
    seqs=st.lists(st.tuples(st.integers(1, 80), st.integers(0, 80)), min_size=1, max_size=5),
    group=st.sampled_from([1, 2, 4]),
    block_size=st.sampled_from([16, 32]),
    window=st.one_of(st.none(), st.integers(1, 40)),
)
def test_reference_matches_dense_on_random_batches(seqs, group, block_size, window):
    seqs = [(length, min(num_q, length)) for length, num_q in seqs]
    batch = make_paged_batch(seqs, 2 * group, 2, 64, block_size)
    out = reference.paged_attention(*batch.args(), sliding_window=window)
    torch.testing.assert_close(out, dense_reference(batch, sliding_window=window), **TOL[torch.float32])


def test_each_sequence_is_independent_of_its_batch_neighbours():
    batch = make_paged_batch(MIXED, 8, 2, 64, 16)
    full = kernels.paged_attention(*batch.args(), backend="reference")
    cu = batch.cu_seqlens_q.tolist()
    for i in range(len(MIXED)):
        alone = kernels.paged_attention(
            batch.q[cu[i]:cu[i + 1]], batch.k_cache, batch.v_cache, batch.block_tables[i:i + 1],
            torch.tensor([0, cu[i + 1] - cu[i]], dtype=torch.int32), batch.seq_lens[i:i + 1],
            backend="reference")
        assert torch.equal(alone, full[cu[i]:cu[i + 1]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_scatters_and_skips_minus_one(dtype):
    k = torch.randn(6, 2, 80, dtype=dtype)
    v = torch.randn(6, 2, 80, dtype=dtype)
    k_cache = torch.zeros(4, 16, 2, 80, dtype=dtype)
    v_cache = torch.zeros(4, 16, 2, 80, dtype=dtype)
    slots = torch.tensor([0, -1, 17, 63, -1, 40])
    kernels.write_kv(k, v, k_cache, v_cache, slots)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(k_cache[slot // 16, slot % 16], k[t])
            assert torch.equal(v_cache[slot // 16, slot % 16], v[t])
    written = {s for s in slots.tolist() if s >= 0}
    untouched = [s for s in range(64) if s not in written]
    assert k_cache.view(64, 2, 80)[untouched].abs().sum() == 0
    assert v_cache.view(64, 2, 80)[untouched].abs().sum() == 0


def test_write_kv_converts_to_cache_dtype():
    k = torch.randn(3, 1, 64)
    k_cache = torch.zeros(1, 16, 1, 64, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    kernels.write_kv(k, k * 2, k_cache, v_cache, torch.tensor([2, 3, 4], dtype=torch.int32))
    assert torch.equal(k_cache[0, 2:5], k.bfloat16())
    assert torch.equal(v_cache[0, 2:5], (k * 2).bfloat16())


@pytest.mark.parametrize("mutate,message", [
    (lambda a: a.update(q=a["q"][0]), "q must be"),
    (lambda a: a.update(v_cache=a["v_cache"][:1]), "k_cache and v_cache"),
    (lambda a: a.update(q=a["q"][..., :32]), "head_dim"),
    (lambda a: a.update(q=a["q"][:, :3]), "multiple of num_kv_heads"),
    (lambda a: a.update(block_tables=a["block_tables"][:1]), "block_tables"),
    (lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"][:-1]), "cu_seqlens_q"),
    (lambda a: a.update(seq_lens=a["seq_lens"].float()), "seq_lens must be int32"),
    (lambda a: a.update(sliding_window=0), "sliding_window"),
])
def test_attention_input_errors_name_the_argument(mutate, message):
    batch = make_paged_batch([(5, 2), (9, 1)], 4, 2, 64, 16)
    args = dict(q=batch.q, k_cache=batch.k_cache, v_cache=batch.v_cache, block_tables=batch.block_tables,
                cu_seqlens_q=batch.cu_seqlens_q, seq_lens=batch.seq_lens)
    mutate(args)
    with pytest.raises(ValueError, match=message):
        kernels.paged_attention(**args)


def test_reference_rejects_inconsistent_values():
    batch = make_paged_batch([(5, 2), (9, 1)], 4, 2, 64, 16)
    with pytest.raises(ValueError, match=r"sequence 0: 2 queries .* seq_lens\[0\] = 1"):
        kernels.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
                                batch.cu_seqlens_q, torch.tensor([1, 9], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"seq_lens\[1\] = 40 needs 3 blocks"):
        kernels.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
                                batch.cu_seqlens_q, torch.tensor([5, 40], dtype=torch.int32))


def test_write_kv_input_errors():
    k = torch.randn(3, 2, 64)
    cache = torch.zeros(2, 16, 2, 64)
    with pytest.raises(ValueError, match="slot_mapping"):
        kernels.write_kv(k, k, cache, cache.clone(), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="caches"):
        kernels.write_kv(k, k, cache[..., :32], cache[..., :32], torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="k and v"):
        kernels.write_kv(k, k[:2], cache, cache.clone(), torch.tensor([0, 1, 2]))


def test_cpu_selection_and_errors():
    assert kernels.available_backends("cpu")[-1] == "reference"
    assert "flash" not in kernels.available_backends("cpu")
    batch = make_paged_batch([(5, 2)], 4, 2, 64, 16)
    with pytest.raises(ValueError, match="unknown attention backend 'cuda'"):
        kernels.paged_attention(*batch.args(), backend="cuda")
    with pytest.raises(RuntimeError, match="backend 'flash' is unavailable: needs CUDA tensors"):
        kernels.paged_attention(*batch.args(), backend="flash")
    with pytest.raises(RuntimeError, match="backend 'flash' is unavailable"):
        kernels.write_kv(batch.q[:, :2], batch.q[:, :2], batch.k_cache, batch.v_cache,
                         torch.tensor([0, 1]), backend="flash")
