"""The compiled CPU extension: build on first use, load; and its decode-attention kernel.

``paged_decode.cpp``, ``fused_ops.cpp``, ``gemv.cpp`` and ``layer_loop.cpp`` (shipped beside this
module: the decode attention here, the fused norm / rotary ops ``elementwise`` calls, the few-row
matmuls ``gemv`` calls, the decode step's layer loop ``layers`` calls; ``vec.h`` and ``ops.h`` hold
what they share) are compiled into one library by ``torch.utils.cpp_extension``
the first time a process needs it — minutes once per checkout (~10 on a 2-vCPU VM, 2026-12-08);
later processes load the cached library from ``$TORCH_EXTENSIONS_DIR`` (default
``~/.cache/torch_extensions``) under ``batchinfer/<name>``, where ``<name>`` carries a digest of the
sources (and where they are), the flags, the compiler and torch's version (and where it is), so a
change of any of them builds afresh instead of loading a stale library, and two checkouts or
virtual environments each keep their own build.

Processes that build at once (test runs, several worker daemons on one machine) take turns on an
``flock`` in that folder, released by the kernel if its holder dies, so a killed build never
leaves the others waiting on torch's lock file forever (a stale one is removed under the flock).

``BATCHINFER_CPU_DECODE_KERNEL`` chooses for the whole library (read on every call, here only):
``auto`` (the default) uses it when it builds, else the torch paths after one logged warning; ``1``
requires it (a build failure raises ``RuntimeError`` with the compiler's reason); ``0`` never builds
or uses it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import sysconfig
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_decode.cpp")
FUSED_SOURCE = Path(__file__).with_name("fused_ops.cpp")  # compiled into the same library
GEMV_SOURCE = Path(__file__).with_name("gemv.cpp")
LAYERS_SOURCE = Path(__file__).with_name("layer_loop.cpp")
# Included by the sources: part of the digest.
HEADERS = (Path(__file__).with_name("vec.h"), Path(__file__).with_name("ops.h"))
ENV = "BATCHINFER_CPU_DECODE_KERNEL"
MODES = ("0", "1", "auto")
# -fopenmp: at::parallel_for's OpenMP region is compiled into the extension (it then runs on the
# libgomp torch loaded). No -march=native: the source picks the instruction set per CPU at load time
# (target_clones), so the cached build stays portable.
# -Wno-psabi: GCC notes that 64-byte vector arguments changed ABI in GCC 4.6 for every such inline
# helper, which would bury a real error in the build log.
CFLAGS = ("-O3", "-fopenmp", "-DNDEBUG", "-Wno-psabi")
LDFLAGS = ("-fopenmp",)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LANES = 16  # the kernel handles head_dim in 16-float vectors: head dims must be multiples of it
# Work items: one per sequence (each block read once for all its KV heads; the default with 4 decode
# rows or more a thread) or one per (sequence, KV head) (more items for the threads).
WORK_SEQUENCE, WORK_HEAD = 0, 1


def kernel_mode(environ: dict[str, str] | None = None) -> str:
    """``BATCHINFER_CPU_DECODE_KERNEL``: ``"0"``, ``"1"`` or ``"auto"`` (unset or empty)."""
    raw = (os.environ if environ is None else environ).get(ENV, "").strip().lower() or "auto"
    if raw not in MODES:
        raise ValueError(f"{ENV}: must be one of 0, 1, auto, got {raw!r}")
    return raw


class Build:
    """One attempt (at most, per instance) to compile ``source`` and ``extra_sources`` into one
    library and load it; thread-safe.

    ``library()`` is the loaded op namespace (``torch.ops.<name>``), ``op()`` its ``paged_decode``;
    both None when the build failed (``reason`` then says why). Never raises."""

    def __init__(self, source: Path = SOURCE, cflags: tuple[str, ...] = CFLAGS,
                 extra_sources: tuple[Path, ...] = (FUSED_SOURCE, GEMV_SOURCE, LAYERS_SOURCE)):
        self.source = source
        self.extra_sources = extra_sources
        self.cflags = cflags
        self.reason: str | None = None
        self._library: Any = None
        self._done = False
        self._lock = threading.Lock()

    def library(self) -> Any:
        """The compiled library's op namespace (building it on the first call), or None."""
        if not self._done:
            with self._lock:
                if not self._done:
                    try:
                        self._library = self._load()
                    except Exception as exc:  # any failure: the torch paths serve instead
                        self.reason = _reason(exc)
                        log.warning("CPU decode kernel unavailable, using the torch path: %s", self.reason)
                    self._done = True
        return self._library

    def op(self) -> Callable[..., None] | None:
        """The compiled ``paged_decode`` operator (building the library on the first call), or None."""
        library = self.library()
        return None if library is None else library.paged_decode

    def compiler(self) -> str:
        """The C++ compiler torch's JIT runs: ``$CXX``, else ``c++``."""
        return os.environ.get("CXX", "c++")

    def name(self) -> str:
        """The extension's name: a digest of the sources (what they hold and where they are), the
        flags, the compiler, torch's and Python's versions and where they are installed.

        The places count because torch's JIT rebuilds whenever its compile commands change, and they
        name the sources' and torch's paths: two checkouts (or virtual environments) sharing one
        cache root rebuilt each other's library in turn (minutes each) under one name."""
        compiler = self.compiler()
        files = (self.source, *self.extra_sources, *HEADERS)
        digests = [hashlib.sha256(path.read_bytes()).hexdigest() for path in files]
        places = [os.path.realpath(path) for path in files]
        installs = [os.path.realpath(os.path.dirname(torch.__file__)), sysconfig.get_paths()["include"]]
        key = "\0".join([*digests, *places, *self.cflags, *LDFLAGS,
                         compiler, os.path.realpath(shutil.which(compiler) or compiler), torch.__version__,
                         f"py{sys.version_info[0]}{sys.version_info[1]}", *installs])
        return "batchinfer_cpu_decode_" + hashlib.sha256(key.encode()).hexdigest()[:16]

    def folder(self) -> Path:
        """Where it is built and cached: ``$TORCH_EXTENSIONS_DIR`` or torch's default root, then
        ``batchinfer/<name>``."""
        from torch.utils import cpp_extension

        root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
        return Path(root) / "batchinfer" / self.name()

    def _load(self) -> Any:
        from torch.utils import cpp_extension

        if shutil.which(self.compiler()) is None:
            raise RuntimeError(f"no C++ compiler: {self.compiler()!r} is not on PATH (set CXX, or install "
                               "g++)")
        if not cpp_extension.is_ninja_available():
            raise RuntimeError("ninja is not on PATH (torch's JIT builds with it: apt install ninja-build "
                               "or pip install ninja)")
        name, folder = self.name(), self.folder()
        folder.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        with _exclusive(folder / "flock"):
            (folder / "lock").unlink(missing_ok=True)  # torch's baton, left by a build that died
            cpp_extension.load(name, [str(path) for path in (self.source, *self.extra_sources)],
                               extra_cflags=[*self.cflags, f"-DBATCHINFER_OPS_NS={name}"],  # the op namespace
                               extra_ldflags=list(LDFLAGS), build_directory=str(folder),
                               is_python_module=False)
        log.info("CPU decode kernel loaded from %s in %.1f s", folder, time.monotonic() - started)
        return getattr(torch.ops, name)


def _reason(exc: Exception, limit: int = 2000) -> str:
    """Why a build failed, in at most ``limit`` characters: the compiler's ``error:`` lines, each
    with the two after it (the source line and the caret), when it printed any (the sources
    compile in parallel, so the log's tail may be another file's); else the message's tail."""
    text = f"{type(exc).__name__}: {exc}".strip()
    lines = text.splitlines()
    picked = {i + j for i, line in enumerate(lines) if "error:" in line for j in range(3)}
    kept = [lines[i] for i in sorted(picked) if i < len(lines)]
    return ("\n".join([lines[0][:300], *kept]) if kept else text)[-limit:]


class _exclusive:
    """An exclusive ``flock`` on ``path`` for the ``with`` block (none where fcntl is missing)."""

    def __init__(self, path: Path):
        self.path = path
        self.fd: int | None = None

    def __enter__(self) -> None:
        try:
            import fcntl
        except ImportError:  # not POSIX: torch's own lock file is all there is
            return
        self.fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing drops the flock
            self.fd = None


_default = Build()


def available() -> bool:
    """True when the kernel is built and loaded (building it on the first call; never raises)."""
    return _default.op() is not None


def library() -> Any:
    """The compiled library's op namespace (building it on the first call), or None when it did not
    build. Never raises."""
    return _default.library()


def usable(x: torch.Tensor) -> bool:
    """Whether ``x`` (a CPU tensor of ``DTYPES``, outside torch.compile) goes to the library's ops
    now: the env switch and the build (``BATCHINFER_CPU_DECODE_KERNEL=1`` with a failed build
    raises ``RuntimeError``)."""
    if x.device.type != "cpu" or x.dtype not in DTYPES or torch.compiler.is_compiling():
        return False
    return _switched_on()


def _switched_on() -> bool:
    """The env switch and the build: ``0`` False, else whether the library built (``1`` with a
    failed build raises ``RuntimeError``)."""
    mode = kernel_mode()
    if mode == "0":
        return False
    if library() is not None:
        return True
    if mode == "1":
        raise RuntimeError(f"{ENV}=1 but the CPU decode kernel did not build: {_default.reason}")
    return False


def unavailable_reason() -> str | None:
    """Why the default build failed (None when it succeeded or was not tried yet)."""
    return _default.reason


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the kernel can take these tensors: a cache dtype of ``DTYPES``, a head_dim that is a
    multiple of ``LANES``, contiguous head_dim axes (the rest takes the torch path)."""
    return (k_cache.dtype in DTYPES and q.shape[-1] % LANES == 0 and q.stride(-1) == 1
            and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1)


def enabled(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether decode rows over this cache go to the kernel now: the env switch, ``supports`` and
    the build. ``BATCHINFER_CPU_DECODE_KERNEL=1`` with a failed build raises ``RuntimeError``."""
    if kernel_mode() == "0" or not supports(q, k_cache, v_cache):
        return False
    return _switched_on()


def paged_decode(
    q: torch.Tensor,  # [Tq, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    block_tables: torch.Tensor,  # [S, max_blocks] int32/int64
    cu_seqlens_q: torch.Tensor,  # [S + 1] int32/int64
    seq_lens: torch.Tensor,  # [S] int32/int64
    scale: float,
    out: torch.Tensor,  # [Tq, H, D], q's dtype: the decode rows are written, other rows left alone
    sliding_window: int | None = None,
    softcap: float | None = None,
    work: int | None = None,
) -> None:
    """Attention of every decode row (a sequence with exactly one query) over its paged context,
    written into ``out``; sequences with 0 or several queries are skipped.

    q, k_cache, v_cache and out share one of ``DTYPES``; CPU tensors with a contiguous head_dim.
    ``work``: ``WORK_SEQUENCE`` / ``WORK_HEAD`` items (None: whole sequences, which read each
    block once for all their KV heads, when there are 4 decode rows or more a thread; else one item
    per (sequence, KV head), so that a few sequences still share out over the threads). Raises
    ``RuntimeError`` when the kernel is unavailable, ``IndexError`` for a block id outside the cache.
    """
    op = _default.op()
    if op is None:
        raise RuntimeError(f"the CPU decode kernel is unavailable: {_default.reason}")
    op(q, k_cache, v_cache, block_tables.contiguous(), cu_seqlens_q.contiguous(), seq_lens.contiguous(),
       float(scale), sliding_window or 0, softcap or 0.0, -1 if work is None else work, out)
