"""The ``cpu`` attention backend against the reference (the specification) and the naive dense
attention, its decode bucketing policy, its value checks, and backend selection on CPU."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from paged_batches import dense_reference, failures_in_threads, make_paged_batch

from batchinfer import kernels
from batchinfer.kernels import cpu_attention, dispatch

# (context length incl. queries, queries): 1-token sequences, decodes of many lengths (several
# buckets), a whole prompt not a multiple of any block size, prefix-cached prefill chunks, a
# sequence with no queries.
MIXED = [(1, 1), (37, 1), (19, 19), (70, 9), (33, 32), (64, 0), (5, 2), (1, 1), (150, 1), (41, 1), (2, 1)]
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _both(batch, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    out = kernels.paged_attention(*batch.args(), backend="cpu", **kw)
    ref = kernels.paged_attention(*batch.args(), backend="reference", **kw)
    return out, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (16, 2)])  # GQA 1, 4, 8
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_cpu_matches_reference(head_dim, num_heads, num_kv_heads, block_size, dtype):
    batch = make_paged_batch(MIXED, num_heads, num_kv_heads, head_dim, block_size, dtype)
    out, ref = _both(batch)
    assert out.shape == batch.q.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])
    torch.testing.assert_close(out.float(), dense_reference(batch), **TOL[dtype])


@pytest.mark.parametrize("window", [1, 4, 16, 33, 1000])
@pytest.mark.parametrize("block_size", [16, 32])
def test_cpu_sliding_window(window, block_size):
    batch = make_paged_batch(MIXED, 8, 2, 64, block_size)
    out, ref = _both(batch, sliding_window=window)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    torch.testing.assert_close(out, dense_reference(batch, sliding_window=window), **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap,window", [(1.5, None), (0.7, 16), (20.0, 4)])
def test_cpu_softcap(softcap, window, dtype):
    """Soft-capping on every CPU path: decode buckets (explicit scores instead of SDPA), a row alone,
    prefill chunks, with and without a window."""
    batch = make_paged_batch(MIXED, 8, 2, 64, 16, dtype)
    out, ref = _both(batch, softcap=softcap, sliding_window=window)
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])
    torch.testing.assert_close(out.float(), dense_reference(batch, sliding_window=window, softcap=softcap),
                               **TOL[dtype])
    if softcap < 10:
        assert not torch.allclose(out, kernels.paged_attention(*batch.args(), sliding_window=window,
                                                               backend="cpu"), atol=1e-3)


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-3), (torch.float64, 2e-5),
                                       (torch.float8_e4m3fn, 0.13)])  # fp8: one ulp at 1.0
def test_other_dtypes_compute_in_float32_or_better(dtype, tol):
    batch = make_paged_batch(MIXED, 8, 2, 64, 16)  # float8 has no randn: convert the inputs
    args = [t.to(dtype) if t.is_floating_point() else t for t in batch.args()]
    out = kernels.paged_attention(*args, sliding_window=20, backend="cpu")
    ref = kernels.paged_attention(*args, sliding_window=20, backend="reference")
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_scale_is_applied():
    batch = make_paged_batch(MIXED, 4, 2, 64, 16)
    out, ref = _both(batch, scale=0.3)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    assert not torch.allclose(out, kernels.paged_attention(*batch.args(), backend="cpu"))


def test_unused_block_table_columns_are_never_read():
    """Columns past a sequence's blocks may hold anything, even ids outside the cache."""
    # 30 and 33 share a decode bucket padded to 3 blocks, 16 and 17 one padded to 2.
    batch = make_paged_batch([(30, 1), (33, 1), (16, 1), (17, 1), (70, 1), (40, 5)], 4, 2, 64, 16)
    tables = batch.block_tables.clone()
    for i, length in enumerate(batch.seq_lens.tolist()):
        tables[i, -(-length // 16):] = 10**6
    args = list(batch.args())
    args[3] = tables
    out = kernels.paged_attention(*args, backend="cpu")
    torch.testing.assert_close(out, dense_reference(batch), **TOL[torch.float32])


def test_decodes_and_prefills_do_not_leak_across_sequences():
    """Changing one sequence's cache and queries leaves every other sequence's output alone."""
    seqs = [(37, 1), (40, 1), (19, 19), (70, 9)]
    batch = make_paged_batch(seqs, 8, 2, 64, 16)
    before = kernels.paged_attention(*batch.args(), backend="cpu")
    victim_blocks = batch.block_tables[1, :3].long()
    batch.k_cache[victim_blocks] = torch.randn_like(batch.k_cache[victim_blocks])
    batch.q[1] = torch.randn_like(batch.q[1])
    after = kernels.paged_attention(*batch.args(), backend="cpu")
    changed = (after - before).abs().amax(dim=(1, 2)) > 0  # per query token
    assert changed.tolist() == [False, True] + [False] * 28


def test_empty_and_zero_query_batches():
    batch = make_paged_batch([(64, 0), (5, 0)], 4, 2, 64, 16)
    out = kernels.paged_attention(*batch.args(), backend="cpu")
    assert out.shape == (0, 4, 64)


def test_value_errors_match_the_reference():
    batch = make_paged_batch([(5, 2), (9, 1)], 4, 2, 64, 16)
    bad_lens = batch.seq_lens.clone()
    bad_lens[0] = 1
    args = list(batch.args())
    args[5] = bad_lens
    with pytest.raises(ValueError, match=r"sequence 0: 2 queries .* seq_lens\[0\] = 1"):
        kernels.paged_attention(*args, backend="cpu")
    args[5] = torch.tensor([5, 40], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"seq_lens\[1\] = 40 needs 3 blocks but block_tables has 1"):
        kernels.paged_attention(*args, backend="cpu")
    args[5], args[4] = batch.seq_lens, torch.tensor([0, 2, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_q must run from 0 to num_q_tokens=3"):
        kernels.paged_attention(*args, backend="cpu")


def test_threads_get_their_own_workspaces():
    """Concurrent calls on different threads never share a gather buffer."""
    batches = [make_paged_batch(MIXED, 8, 2, 64, 16, generator=torch.Generator().manual_seed(s))
               for s in range(4)]
    expected = [kernels.paged_attention(*b.args(), backend="reference") for b in batches]

    def close(i: int) -> bool:
        out = kernels.paged_attention(*batches[i].args(), backend="cpu")
        return torch.allclose(out, expected[i], atol=2e-5, rtol=2e-5)

    assert failures_in_threads(close) == []


@settings(max_examples=25, deadline=None)
@given(
    seqs=st.lists(st.tuples(st.integers(1, 90), st.integers(0, 90)), min_size=1, max_size=8),
    decode_share=st.floats(0, 1),
    group=st.sampled_from([1, 2, 4, 8]),
    block_size=st.sampled_from([16, 32]),
    window=st.one_of(st.none(), st.integers(1, 40)),
    seed=st.integers(0, 2**16),
)
def test_random_batches_match_reference(seqs, decode_share, group, block_size, window, seed):
    # Make about ``decode_share`` of the sequences decodes so buckets of every size appear.
    cut = round(decode_share * len(seqs))
    seqs = [(n, 1) for n, _ in seqs[:cut]] + [(n, min(q, n)) for n, q in seqs[cut:]]
    gen = torch.Generator().manual_seed(seed)
    batch = make_paged_batch(seqs, 2 * group, 2, 32, block_size, generator=gen)
    out, ref = _both(batch, sliding_window=window)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


@given(lengths=st.lists(st.integers(1, 5000), max_size=300))
def test_decode_buckets_cover_each_row_once_within_bounds(lengths):
    rows = list(enumerate(lengths))
    buckets = cpu_attention.decode_buckets(rows)
    assert sorted(r for b in buckets for r in b) == sorted(rows)
    for bucket in buckets:
        assert 1 <= len(bucket) <= cpu_attention.MAX_BUCKET_ROWS
        padded, real = len(bucket) * max(n for _, n in bucket), sum(n for _, n in bucket)
        assert len(bucket) == 1 or padded <= cpu_attention.PAD_WASTE * real


def test_decode_buckets_group_equal_lengths():
    assert cpu_attention.decode_buckets([(0, 10), (1, 100), (2, 10), (3, 100)]) == [
        [(0, 10), (2, 10)], [(1, 100), (3, 100)]]


@given(lengths=st.lists(st.integers(1, 5000), max_size=300), max_keys=st.integers(1, 20000))
def test_decode_buckets_stay_within_the_key_budget(lengths, max_keys):
    rows = list(enumerate(lengths))
    buckets = cpu_attention.decode_buckets(rows, max_keys=max_keys)
    assert sorted(r for b in buckets for r in b) == sorted(rows)
    for bucket in buckets:
        assert len(bucket) == 1 or len(bucket) * max(n for _, n in bucket) <= max_keys


@pytest.mark.parametrize("window", [None, 1, 50, 129])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2)])
def test_long_prefills_and_lone_decodes_match_reference(window, num_heads, num_kv_heads, monkeypatch):
    """Prefills over several ``PREFILL_CHUNK``s (whole prompts and prefix-cached chunks), and
    decodes split into one-row buckets by a tiny ``BUCKET_BYTES``."""
    monkeypatch.setattr(cpu_attention, "BUCKET_BYTES", 1)
    seqs = [(300, 300), (400, 250), (260, 130), (129, 129), (700, 1), (700, 1), (45, 1), (5, 1)]
    batch = make_paged_batch(seqs, num_heads, num_kv_heads, 64, 16)
    out, ref = _both(batch, sliding_window=window)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    torch.testing.assert_close(out, dense_reference(batch, sliding_window=window), **TOL[torch.float32])


def test_cpu_tensors_pick_the_cpu_backend(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert kernels.available_backends("cpu") == ["cpu", "reference"]
    assert dispatch.select_backend(None, torch.device("cpu"), torch.float32) == "cpu"
    assert dispatch.select_backend(None, torch.device("cpu"), torch.int8) == "reference"
    assert "floating-point" in dispatch.unavailable_reason("cpu", "cpu", torch.int8)
    assert dispatch.unavailable_reason("cpu", "cuda") == "needs CPU tensors (got cuda)"
    assert "cpu" not in kernels.available_backends("cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter never displaces it
    assert dispatch.available_backends("cpu") == ["cpu", "triton", "reference"]
    assert dispatch.select_backend(None, torch.device("cpu")) == "cpu"


def test_default_backend_runs_the_cpu_path(monkeypatch):
    """``backend=None`` on CPU tensors reaches cpu_attention (seen through its workspaces)."""
    batch = make_paged_batch([(37, 1), (19, 19)], 4, 2, 64, 16)
    seen: list[str] = []
    real = cpu_attention._workspace
    monkeypatch.setattr(cpu_attention, "_workspace", lambda *a: seen.append(a[-1]) or real(*a))
    out = kernels.paged_attention(*batch.args())
    assert seen and set(seen) == {"k", "v"}
    torch.testing.assert_close(out, dense_reference(batch), **TOL[torch.float32])


def test_workspace_made_in_inference_mode_is_not_reused_outside_it():
    # the engine runs under inference_mode; a later call outside it (a test, a user) must still work
    from batchinfer.kernels import cpu_attention

    with torch.inference_mode():
        inside = cpu_attention._workspace(16, torch.float32, torch.device("cpu"), "test-slot")
    outside = cpu_attention._workspace(16, torch.float32, torch.device("cpu"), "test-slot")
    assert inside.is_inference() and not outside.is_inference()
    outside.fill_(1.0)  # raised "Inplace update to inference tensor outside InferenceMode" before
