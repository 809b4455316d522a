"""The compiled CPU decode kernel (kernels/cpu_ext): against the reference backend, wired into the cpu
backend (on / off / fallback), its build failures, concurrent builds, and a worker that builds it
before it registers."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from paged_batches import dense_reference, failures_in_threads, make_paged_batch

from batchinfer import kernels
from batchinfer.kernels import cpu_attention, reference
from batchinfer.kernels.cpu_ext import decode
from batchinfer.ops.startup import StartupError
from batchinfer.workers.service.serve import build_engine, prepare_cpu_kernels

# Decode rows of lengths 1, block multiples (16, 32, 48) and ragged ones, plus a prefill chunk and a
# zero-query sequence, which the kernel must leave alone.
SEQS = [(1, 1), (16, 1), (37, 1), (19, 19), (32, 1), (64, 0), (48, 1), (5, 1), (150, 1), (2, 1)]
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}

can_build = shutil.which(os.environ.get("CXX", "c++")) is not None and shutil.which("ninja") is not None
needs_kernel = pytest.mark.skipif(not can_build, reason="no C++ compiler or ninja: the kernel cannot build")


@pytest.fixture(scope="module")
def built() -> None:
    """The default build, once per module; with a compiler and ninja present it must succeed."""
    assert decode.available(), decode.unavailable_reason()


def _decode_rows(batch) -> list[int]:
    cu = batch.cu_seqlens_q.tolist()
    return [cu[i] for i in range(len(cu) - 1) if cu[i + 1] - cu[i] == 1]


def _run_kernel(batch, work=None, **kw) -> torch.Tensor:
    """The kernel's output over a NaN-filled ``out``: rows it must not touch stay NaN."""
    out = torch.full_like(batch.q, float("nan"))
    decode.paged_decode(*batch.args(), batch.q.shape[2] ** -0.5, out, work=work, **kw)
    return out


def _check_against_reference(batch, out: torch.Tensor, **kw) -> None:
    rows = _decode_rows(batch)
    others = sorted(set(range(batch.q.shape[0])) - set(rows))
    ref = reference.paged_attention(*batch.args(), **kw)
    tol = TOL[batch.q.dtype]
    torch.testing.assert_close(out[rows].float(), ref[rows].float(), **tol)
    torch.testing.assert_close(out[rows].float(), dense_reference(batch, **kw)[rows], **tol)
    assert out[others].isnan().all()  # the prefill chunk's rows: not the kernel's


@needs_kernel
@pytest.mark.parametrize("work", [decode.WORK_SEQUENCE, decode.WORK_HEAD])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 2), (9, 3)])  # GQA G = 1, 3, 4, 3
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_kernel_matches_reference(built, work, dtype, num_heads, num_kv_heads, head_dim):
    """Both kinds of work item: a whole sequence reads each block for all its KV heads in one visit
    (heads interleaved inside the block loop), a (sequence, KV head) item one head's rows."""
    batch = make_paged_batch(SEQS, num_heads, num_kv_heads, head_dim, 16, dtype)
    out = _run_kernel(batch, work=work)
    assert out.dtype == dtype
    _check_against_reference(batch, out)


@needs_kernel
@pytest.mark.parametrize("work", [None, decode.WORK_SEQUENCE, decode.WORK_HEAD])
@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
@pytest.mark.parametrize("window,softcap", [(None, None), (1, None), (16, None), (33, None), (1000, None),
                                            (None, 1.5), (7, 20.0), (16, 0.7)])
def test_windows_softcap_and_block_sizes(built, work, block_size, window, softcap):
    batch = make_paged_batch(SEQS, 6, 2, 64, block_size, generator=torch.Generator().manual_seed(block_size))
    out = _run_kernel(batch, work=work, sliding_window=window, softcap=softcap)
    _check_against_reference(batch, out, sliding_window=window, softcap=softcap)


@needs_kernel
@pytest.mark.parametrize("work", [decode.WORK_SEQUENCE, decode.WORK_HEAD])
@pytest.mark.parametrize("threads", [1, 2])
def test_work_items_and_threads_agree(built, work, threads):
    """Per-sequence and per-(sequence, KV head) items, on one thread and on two, give the same
    numbers (each item's arithmetic is the same whoever runs it)."""
    batch = make_paged_batch(SEQS * 3, 8, 2, 64, 16, torch.bfloat16)
    expected = _run_kernel(batch, work=decode.WORK_SEQUENCE)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = _run_kernel(batch, work=work)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out, expected, atol=0, rtol=0, equal_nan=True)
    _check_against_reference(batch, out)


@needs_kernel
@pytest.mark.parametrize("seqs", [[(40, 1)], [(40, 1), (3, 1)], [(17, 1), (33, 0), (70, 1)]])
def test_fewer_items_than_threads(built, seqs):
    """A thread claims its next item before it runs the current one (to prefetch its keys): with
    fewer items than threads, one thread may take two and another none; every decode row is
    written once and right, whatever the item order."""
    batch = make_paged_batch(seqs, 8, 2, 64, 16, torch.float32)
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        out = _run_kernel(batch)  # over NaN: a decode row no thread wrote fails the check below
    finally:
        torch.set_num_threads(before)
    _check_against_reference(batch, out)


@needs_kernel
def test_scale_and_strided_inputs(built):
    """A given scale; q a strided view (a fused projection's), caches views of a [2, ...] tensor."""
    batch = make_paged_batch(SEQS, 8, 2, 64, 16)
    kv = torch.stack([batch.k_cache, batch.v_cache])  # [2, num_blocks, bs, KVH, D]
    fused = torch.cat([batch.q, torch.randn_like(batch.q)], dim=1)  # [T, 2H, D]
    q = fused[:, :8]
    assert not q.is_contiguous()
    out = torch.full_like(batch.q, float("nan"))
    decode.paged_decode(q, kv[0], kv[1], batch.block_tables, batch.cu_seqlens_q, batch.seq_lens, 0.3, out)
    _check_against_reference(batch, out, scale=0.3)


@needs_kernel
def test_block_ids_are_checked_but_unused_columns_never_read(built):
    batch = make_paged_batch([(30, 1), (33, 1), (70, 1), (40, 5)], 4, 2, 64, 16)
    tables = batch.block_tables.clone()
    for i, length in enumerate(batch.seq_lens.tolist()):
        tables[i, -(-length // 16):] = 10**6  # past each sequence's blocks: anything goes
    out = torch.full_like(batch.q, float("nan"))
    decode.paged_decode(batch.q, batch.k_cache, batch.v_cache, tables, batch.cu_seqlens_q, batch.seq_lens,
                        0.125, out)
    torch.testing.assert_close(out[:3], dense_reference(batch, scale=0.125)[:3], **TOL[torch.float32])
    tables[1, 1] = batch.k_cache.shape[0]  # a block it reads, one past the cache
    with pytest.raises(IndexError, match="sequence 1 block 1 is .* outside the cache"):
        decode.paged_decode(batch.q, batch.k_cache, batch.v_cache, tables, batch.cu_seqlens_q, batch.seq_lens,
                            0.125, out)
    tables[1, 1] = -1
    with pytest.raises(IndexError, match="sequence 1 block 1 is -1"):
        decode.paged_decode(batch.q, batch.k_cache, batch.v_cache, tables, batch.cu_seqlens_q, batch.seq_lens,
                            0.125, out)


@needs_kernel
def test_concurrent_calls_from_threads(built):
    batches = [make_paged_batch(SEQS, 8, 2, 64, 16, generator=torch.Generator().manual_seed(s))
               for s in range(4)]
    expected = [_run_kernel(b) for b in batches]

    def same(i: int) -> bool:
        return torch.equal(_run_kernel(batches[i]).nan_to_num(), expected[i].nan_to_num())

    assert failures_in_threads(same) == []


# -- wired into the cpu backend ------------------------------------------------------------------------

def _gathers(monkeypatch) -> list[str]:
    """The cpu backend's gather workspaces requested from now on (its torch path's footprint)."""
    seen: list[str] = []
    real = cpu_attention._workspace
    monkeypatch.setattr(cpu_attention, "_workspace", lambda *a: seen.append(a[-1]) or real(*a))
    return seen


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_backend_with_the_kernel_on_and_off(built, dtype, monkeypatch):
    batch = make_paged_batch(SEQS, 8, 2, 64, 16, dtype)
    seen = _gathers(monkeypatch)
    monkeypatch.setenv(decode.ENV, "1")
    on = kernels.paged_attention(*batch.args(), backend="cpu", sliding_window=20, softcap=3.0)
    prefill = ["k", "v"] if dtype == torch.float32 else ["k", "k/compute", "v", "v/compute"]
    assert seen == prefill  # the prefill chunk's gather only
    seen.clear()
    monkeypatch.setenv(decode.ENV, "0")
    off = kernels.paged_attention(*batch.args(), backend="cpu", sliding_window=20, softcap=3.0)
    assert len(seen) > len(prefill)  # the decode buckets gathered too
    torch.testing.assert_close(on.float(), off.float(), **TOL[dtype])
    ref = kernels.paged_attention(*batch.args(), backend="reference", sliding_window=20, softcap=3.0)
    torch.testing.assert_close(on.float(), ref.float(), **TOL[dtype])


@needs_kernel
def test_decode_only_batches_gather_nothing(built, monkeypatch):
    """With the kernel, a batch of decodes never touches the gather workspaces; with the switch at
    0 (or auto and an unsupported head_dim), it does."""
    batch = make_paged_batch([(37, 1), (16, 1), (150, 1)], 8, 2, 64, 16)
    seen = _gathers(monkeypatch)
    monkeypatch.delenv(decode.ENV, raising=False)  # auto
    kernels.paged_attention(*batch.args())
    assert seen == []
    monkeypatch.setenv(decode.ENV, "0")
    kernels.paged_attention(*batch.args())
    assert set(seen) == {"k", "v"}
    seen.clear()
    monkeypatch.setenv(decode.ENV, "auto")
    odd = make_paged_batch([(37, 1), (16, 1)], 4, 2, 72, 16)  # head_dim 72: not a multiple of 16
    out = kernels.paged_attention(*odd.args())
    assert set(seen) == {"k", "v"}
    torch.testing.assert_close(out, dense_reference(odd), **TOL[torch.float32])


def test_the_switch_is_read_and_checked(monkeypatch):
    monkeypatch.delenv(decode.ENV, raising=False)
    assert decode.kernel_mode() == "auto"
    assert decode.kernel_mode({decode.ENV: " 0 "}) == "0"
    assert decode.kernel_mode({decode.ENV: "AUTO"}) == "auto"
    assert decode.kernel_mode({decode.ENV: ""}) == "auto"
    with pytest.raises(ValueError, match="BATCHINFER_CPU_DECODE_KERNEL: must be one of 0, 1, auto, got 'ye"):
        decode.kernel_mode({decode.ENV: "yes"})
    monkeypatch.setenv(decode.ENV, "yes")
    batch = make_paged_batch([(5, 1)], 4, 2, 64, 16)
    with pytest.raises(ValueError, match="BATCHINFER_CPU_DECODE_KERNEL"):
        kernels.paged_attention(*batch.args())


def test_switch_off_never_builds(monkeypatch):
    """``0`` answers from the torch path without trying a build (a build that would fail says so)."""
    broken = decode.Build(source=Path("/nonexistent/paged_decode.cpp"))
    monkeypatch.setattr(decode, "_default", broken)
    monkeypatch.setenv(decode.ENV, "0")
    batch = make_paged_batch(SEQS, 8, 2, 64, 16)
    out = kernels.paged_attention(*batch.args(), backend="cpu")
    torch.testing.assert_close(out, dense_reference(batch), **TOL[torch.float32])
    assert broken.reason is None  # never tried


# -- build failures -------------------------------------------------------------------------------------

def test_a_broken_source_falls_back_to_the_torch_path(tmp_path, monkeypatch, caplog):
    """A source that does not compile: ``op()`` is None with the compiler's complaint (logged once),
    ``auto`` answers from the torch path, ``1`` raises."""
    if not can_build:
        pytest.skip("no C++ compiler or ninja")
    source = tmp_path / "paged_decode.cpp"
    source.write_text("this is not C++;\n")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    broken = decode.Build(source=source)
    with caplog.at_level(logging.WARNING, logger=decode.__name__):
        assert broken.op() is None
        assert broken.op() is None  # tried once
    assert broken.reason is not None and "this is not C++" in broken.reason, broken.reason
    assert [r.message for r in caplog.records if "unavailable" in r.message] == [
        f"CPU decode kernel unavailable, using the torch path: {broken.reason}"]
    assert broken.folder().parent == tmp_path / "ext" / "batchinfer"

    monkeypatch.setattr(decode, "_default", broken)
    assert not decode.available()
    batch = make_paged_batch(SEQS, 8, 2, 64, 16)
    monkeypatch.setenv(decode.ENV, "auto")
    out = kernels.paged_attention(*batch.args())
    torch.testing.assert_close(out, dense_reference(batch), **TOL[torch.float32])
    monkeypatch.setenv(decode.ENV, "1")
    with pytest.raises(RuntimeError, match="(?s)BATCHINFER_CPU_DECODE_KERNEL=1 but the CPU decode kernel "
                                           "did not build: .*this is not C"):
        kernels.paged_attention(*batch.args())
    with pytest.raises(RuntimeError, match="the CPU decode kernel is unavailable"):
        decode.paged_decode(*batch.args(), 0.125, torch.empty_like(batch.q))


def test_a_missing_compiler_is_reported(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    build = decode.Build()
    assert build.op() is None
    assert build.reason == ("RuntimeError: no C++ compiler: '/nonexistent/c++' is not on PATH (set CXX, or "
                            "install g++)")


@needs_kernel
@pytest.mark.timeout(300)
def test_a_stale_torch_lock_does_not_hang_the_load(built, tmp_path):
    """A build killed mid-way leaves torch's ``lock`` file behind, which torch's own JIT waits on
    forever; the loader removes it under its flock (released by the kernel when a holder dies)."""
    folder = decode.Build().folder()
    (folder / "lock").touch()
    code = ("from batchinfer.kernels.cpu_ext import decode; import sys; "
            "sys.exit(0 if decode.available() else decode.unavailable_reason())")
    done = subprocess.run([sys.executable, "-P", "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not (folder / "lock").exists()


@needs_kernel
@pytest.mark.slow
@pytest.mark.timeout(1500)  # a whole build from a cold cache: 455 s in CI on 2026-12-08, the library grows
def test_processes_building_at_once_take_turns(tmp_path):
    """Two processes on a cold cache at once (worker daemons on a fresh machine): one builds, the
    other waits on the flock and loads the result; both get the kernel and the same answers."""
    code = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from paged_batches import make_paged_batch
from batchinfer.kernels.cpu_ext import decode
assert decode.available(), decode.unavailable_reason()
batch = make_paged_batch([(37, 1), (150, 1)], 8, 2, 64, 16)
out = torch.zeros_like(batch.q)
decode.paged_decode(*batch.args(), 0.125, out)
print(float(out.sum()))
"""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    tests = str(Path(__file__).parent)
    procs = [subprocess.Popen([sys.executable, "-P", "-c", code, tests], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [p.communicate(timeout=540) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-3000:] for _, err in results]
    assert results[0][0] == results[1][0]
    [folder] = (tmp_path / "ext" / "batchinfer").iterdir()
    assert len(list(folder.glob("*.so"))) == 1


def test_each_checkout_keeps_its_own_build(tmp_path):
    """torch's JIT rebuilds when its compile commands change, and they name the sources' paths: the
    same sources in another folder (another checkout) get a build folder of their own, where they
    once took over (and rebuilt) the other's."""
    sources = (decode.SOURCE, decode.FUSED_SOURCE, decode.GEMV_SOURCE, decode.LAYERS_SOURCE)
    for path in sources:
        shutil.copy(path, tmp_path / path.name)
    copy = decode.Build(source=tmp_path / decode.SOURCE.name,
                        extra_sources=tuple(tmp_path / path.name for path in sources[1:]))
    assert decode.Build().name() == decode.Build().name()  # the same checkout: one folder
    assert copy.name() != decode.Build().name()
    assert copy.folder().parent == decode.Build().folder().parent  # under the same cache root

# -- the worker's start ------------------------------------------------------------------------------------

def test_a_cpu_worker_loads_the_library_while_it_builds_its_engine(tiny_llama, monkeypatch):
    """``build_engine`` (the worker's start, before it registers) builds or loads the library, not
    the engine's first step: a fresh machine's build must not stall a registered worker."""
    fresh = decode.Build()  # the default sources: the cache the tiny_llama fixture filled
    loads = []
    load = fresh._load
    monkeypatch.setattr(fresh, "_load", lambda: loads.append(1) or load())
    monkeypatch.setattr(decode, "_default", fresh)
    monkeypatch.delenv(decode.ENV, raising=False)
    engine = build_engine(str(tiny_llama), "cpu", False, {"num_kv_blocks": 16})
    assert loads == [1] and engine.num_unfinished() == 0  # loaded before any step ran
    assert (fresh.reason is None) is can_build, fresh.reason
    build_engine(None, "cpu", True, {})  # the echo engine needs no library
    assert loads == [1]


def test_a_worker_that_requires_the_library_refuses_to_start_without_it(tmp_path, monkeypatch):
    broken = decode.Build(source=tmp_path / "missing.cpp")
    monkeypatch.setattr(decode, "_default", broken)
    monkeypatch.setenv(decode.ENV, "0")
    prepare_cpu_kernels()
    assert broken.reason is None  # off: never tried
    monkeypatch.setenv(decode.ENV, "yes")
    with pytest.raises(StartupError, match="BATCHINFER_CPU_DECODE_KERNEL: must be one of 0, 1, auto, got"):
        prepare_cpu_kernels()
    monkeypatch.setenv(decode.ENV, "auto")
    prepare_cpu_kernels()  # the torch paths serve: the build's warning says why
    assert broken.reason is not None
    monkeypatch.setenv(decode.ENV, "1")
    with pytest.raises(StartupError, match="BATCHINFER_CPU_DECODE_KERNEL=1 but the CPU kernels did not"):
        prepare_cpu_kernels()
