"""bench/decode_ab.py: which earlier kernel it builds beside this checkout's (building is left to the
bench: a second library costs minutes on CI's two cores)."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_scripts import bench_script

from batchinfer.kernels.cpu_ext import decode


def test_the_earlier_kernel_builds_alone_in_its_own_namespace(tmp_path):
    (tmp_path / "fused_ops.cpp").write_text("// not the kernel\n")
    with bench_script("decode_ab") as bench:
        with pytest.raises(SystemExit, match="no paged_decode.cpp"):
            bench.earlier_build(tmp_path)
        build = bench.earlier_build(Path(decode.SOURCE).parent)
    assert build.source == decode.SOURCE and build.extra_sources == ()
    assert "-DBATCHINFER_OPS_NS=batchinfer_decode_ab" in build.cflags  # loads beside the default library
    assert build.name() != decode.Build().name()  # and caches apart from it
