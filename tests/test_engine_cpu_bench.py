"""bench/engine_cpu.py's roofline arithmetic (``FlopModel.roofline``): the plain ceiling lets a step's
K/V read overlap its matmuls, the per-op one times the decode rows' read after them."""

from __future__ import annotations

import pytest
from bench_scripts import bench_script


@pytest.fixture(scope="module")
def bench():
    with bench_script("engine_cpu") as module:
        yield module


def flop_model(bench, replayed):
    """A FlopModel holding only its replayed steps (what ``roofline`` reads)."""
    model = object.__new__(bench.FlopModel)
    model.replayed = [bench.ReplayedStep(*step) for step in replayed]
    return model


def test_roofline_and_per_op_ceiling_by_hand(bench):
    # (FLOPs, bytes, matmul FLOP/s, engine s, the decode rows' attention FLOPs, their K/V bytes)
    steps = [
        (100.0, 50.0, 10.0, 20.0, 0.0, 0.0),     # a prefill: compute 10 s, memory 5 s; no decode rows
        (40.0, 300.0, 10.0, 40.0, 10.0, 200.0),  # decode-heavy: compute 4 s, memory 30 s
    ]
    roof = flop_model(bench, steps).roofline(bandwidth=10.0)
    assert roof["ceiling_s"] == pytest.approx(10.0 + 30.0)
    assert roof["engine_s"] == pytest.approx(60.0)
    assert roof["efficiency"] == pytest.approx(40.0 / 60.0)
    assert roof["memory_bound_share"] == pytest.approx(0.5)
    # per op: step 1 as before (10 s); step 2 max(30 / 10, 100 / 10) + 200 / 10 = 10 + 20
    assert roof["serial_ceiling_s"] == pytest.approx(10.0 + 30.0)
    assert roof["serial_efficiency"] == pytest.approx(40.0 / 60.0)


def test_the_per_op_ceiling_adds_the_decode_read_to_the_matmuls(bench):
    # compute 80 / 10 = 8 s of which attention 20 FLOPs; bytes 60, of them 40 the decode rows' K/V
    roof = flop_model(bench, [(80.0, 60.0, 10.0, 16.0, 20.0, 40.0)]).roofline(bandwidth=10.0)
    assert roof["ceiling_s"] == pytest.approx(8.0)  # max(8, 6): the read hides under the matmuls
    assert roof["serial_ceiling_s"] == pytest.approx(max(60 / 10, 20 / 10) + 40 / 10)  # 6 + 4
    assert roof["serial_efficiency"] == pytest.approx(10.0 / 16.0)


def test_no_replayed_step_no_roofline(bench):
    assert flop_model(bench, []).roofline(bandwidth=1.0) is None
