"""bench/kernels_gpu.py on CPU: its --dry-run path (tiny shapes, reference backend, wall-clock
timers) builds every section and prints the table last; without CUDA it refuses clearly."""

from __future__ import annotations

import json

import pytest
import torch
from bench_scripts import bench_script


@pytest.fixture(scope="module")
def bench():
    with bench_script("kernels_gpu") as module:
        yield module


def test_dry_run_prints_every_section_and_the_table_last(bench, tmp_path, capsys):
    out_json = tmp_path / "rows.json"
    assert bench.main(["--dry-run", "--iters", "2", "--json", str(out_json)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("section"))
    table = lines[header + 2:]
    assert table and all(line.split()[0] in {"correct", "bandwidth", "decode", "prefill"} for line in table)
    rows = json.loads(out_json.read_text())
    assert len(rows) == len(table)
    sections = {r["section"] for r in rows}
    assert sections == {"correct", "bandwidth", "decode", "prefill"}
    assert all(r["status"] == "PASS" for r in rows if r["section"] == "correct")
    decode = [r for r in rows if r["section"] == "decode" and r["backend"] == "reference"]
    assert len(decode) == len(bench.DRY.decode) and all(r["time_us"] > 0 and r["ratio"] is not None
                                                        for r in decode)


def test_table_formatting_aligns_columns(bench):
    rows = [bench.Row("decode", "decode b=64 ctx=1024", "triton", 123.456, "3000 GB/s", "copy bandwidth",
                      0.712, ">= 70%", "PASS"),
            bench.Row("correct", "write_kv", "triton", metric="bit-exact", status="PASS")]
    lines = bench.format_table(rows).splitlines()
    assert lines[0].split()[:3] == ["section", "case", "backend"]
    assert "123.5" in lines[2] and "0.71" in lines[2]
    assert lines[2].index("triton") == lines[3].index("triton") == lines[0].index("backend")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA refusal")
def test_without_cuda_it_exits_2_with_a_clear_message(bench, capsys):
    assert bench.main([]) == 2
    assert "CUDA is not available" in capsys.readouterr().err
