"""Speculative decoding's statistics: ``Engine.spec_stats()`` moves the ``batchinfer_spec_*`` counters
by its growth, reaches the heartbeat, and ``batchinfer top`` shows acceptance and accepted length.

The unit tests feed :class:`WorkerMetrics` cumulative dicts as the engine reports them (the way
``test_metrics`` feeds it engine state); the daemon test runs a real worker daemon on Redis with
an echo engine that reports speculation counters, and reads them back through the heartbeat and
``top``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from daemons import wait_until
from prometheus_client.parser import text_string_to_metric_families
from test_top import known_snapshot, row_of
from test_top_width import realistic
from test_worker_daemon import KEYS, Running, _job, _rows

from batchinfer.cli.top import render_to_text, snapshot_from_redis, snapshot_to_dict
from batchinfer.ops.metrics import WorkerMetrics
from batchinfer.store.queue_state import WorkerView
from batchinfer.workers.engine.outputs import RequestOutput
from batchinfer.workers.service.echo_engine import EchoEngine

SPEC_COUNTERS = ("batchinfer_spec_drafts_total", "batchinfer_spec_draft_tokens_total",
                 "batchinfer_spec_accepted_tokens_total", "batchinfer_spec_steps_total",
                 "batchinfer_spec_disabled_steps_total")


def spec_samples(metrics: WorkerMetrics) -> dict[tuple[str, str], float]:
    """``(metric, method or "") -> value`` of every ``batchinfer_spec_*`` sample, from the scrape text."""
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            if s.name.startswith("batchinfer_spec_"):
                assert s.labels["model"] == metrics.model
                out[(s.name, s.labels.get("method", ""))] = s.value
    return out


def stats(ngram: tuple[int, int, int], prediction: tuple[int, int, int] | None = None, steps: int = 0,
          disabled: int = 0) -> dict[str, Any]:
    """``Engine.spec_stats()``: (drafts, draft tokens, accepted tokens) per method, cumulative."""
    per = {"ngram": ngram, **({"prediction": prediction} if prediction else {})}
    return {"methods": {m: dict(zip(("drafts", "draft_tokens", "accepted_tokens"), v, strict=True))
                        for m, v in per.items()},
            "steps": steps, "disabled_steps": disabled}


def test_an_engine_that_never_speculates_exports_and_reports_nothing():
    m = WorkerMetrics("m")
    m.set_spec_stats({})
    m.set_spec_stats(None)  # the protocol's stub on an engine that has not implemented it
    assert spec_samples(m) == {}
    assert not any(k.startswith("spec_") for k in m.heartbeat_fields())


def test_cumulative_stats_move_the_counters_by_their_growth_only():
    m = WorkerMetrics("m")
    m.set_spec_stats(stats((0, 0, 0), steps=0, disabled=3))  # speculating, but nothing drafted yet
    assert spec_samples(m)[("batchinfer_spec_disabled_steps_total", "")] == 3
    assert not any(k.startswith("spec_") for k in m.heartbeat_fields())  # no rate without drafts
    m.set_spec_stats(stats((2, 8, 5), steps=2, disabled=3))
    m.set_spec_stats(stats((2, 8, 5), steps=2, disabled=3))  # cumulative: the same again adds nothing
    m.set_spec_stats(stats((4, 16, 9), prediction=(1, 10, 10), steps=4, disabled=5))
    assert spec_samples(m) == {
        ("batchinfer_spec_drafts_total", "ngram"): 4, ("batchinfer_spec_drafts_total", "prediction"): 1,
        ("batchinfer_spec_draft_tokens_total", "ngram"): 16,
        ("batchinfer_spec_draft_tokens_total", "prediction"): 10,
        ("batchinfer_spec_accepted_tokens_total", "ngram"): 9,
        ("batchinfer_spec_accepted_tokens_total", "prediction"): 10,
        ("batchinfer_spec_steps_total", ""): 4, ("batchinfer_spec_disabled_steps_total", ""): 5}
    beat = m.heartbeat_fields()
    assert beat["spec_acceptance"] == round(19 / 26, 4)  # accepted / draft tokens, all methods
    assert beat["spec_accepted_len"] == round(1 + 19 / 5, 3)  # + the token every step makes


def speculating_worker_view(**kw: Any) -> WorkerView:
    return dataclasses.replace(known_snapshot().workers[0], spec_acceptance=0.7123, spec_accepted_len=2.851,
                               **kw)


def test_top_shows_acceptance_and_length_only_for_speculating_workers():
    plain = render_to_text(known_snapshot(), width=160)
    assert "spec" not in plain  # no worker speculates: no column
    snap = known_snapshot()
    snap.workers[0] = speculating_worker_view()
    text = render_to_text(snap, width=160)
    assert "spec acc/len" in text
    assert "71% 2.85" in row_of(text, "gpu-a")
    assert "71%" not in row_of(text, "gpu-b")  # silent worker: "-"
    worker = snapshot_to_dict(snap)["workers"][0]
    assert (worker["spec_acceptance"], worker["spec_accepted_len"]) == (0.7123, 2.851)


def test_the_spec_column_fits_80_columns():
    snap = realistic()
    snap.workers[0] = speculating_worker_view(model="SmolLM2-135M-Instruct")
    for width in (80, 100):
        text = render_to_text(snap, width=width)
        assert "…" not in text and all(len(line) <= width for line in text.splitlines())
        assert "spec" in text and "71%" in text and "2.85" in text, width


class SpeculatingEcho(EchoEngine):
    """The echo engine, reporting that every step verified an ngram draft (4 tokens, 3 accepted) and
    a prediction (2 tokens, none accepted)."""

    def __init__(self, **kw: Any):
        super().__init__(**kw)
        self.spec_steps = 0

    def step(self) -> list[RequestOutput]:
        self.spec_steps += 1
        return super().step()

    def spec_stats(self) -> dict[str, Any]:
        n = self.spec_steps
        return stats((n, 4 * n, 3 * n), prediction=(n, 2 * n, 0), steps=n, disabled=0)


def test_a_speculating_worker_reports_through_prometheus_the_heartbeat_and_top(redis_server):
    r = redis_server.client()
    _job(r, "jsp", 6, per_batch=2)
    engine = SpeculatingEcho(requests_per_step=1, max_num_seqs=4)
    worker = Running(r, engine)
    wait_until(lambda: len(_rows(r, "jsp")) == 6, what="6 rows")
    view = wait_until(lambda: next((w for w in snapshot_from_redis(r, KEYS).workers
                                    if w.spec_acceptance is not None), None),
                      what="a heartbeat with the speculation fields")
    assert (view.spec_acceptance, view.spec_accepted_len) == (0.5, 2.5)  # 3 of 6; 1 + 3 per 2 drafts
    assert "spec_acceptance" not in view.extra
    assert "50% 2.50" in row_of(render_to_text(snapshot_from_redis(r, KEYS), width=160), "w1")
    assert worker.stop() == 0
    n = engine.spec_steps
    assert n >= 6  # one request per step
    assert spec_samples(worker.daemon.metrics) == {
        ("batchinfer_spec_drafts_total", "ngram"): n, ("batchinfer_spec_drafts_total", "prediction"): n,
        ("batchinfer_spec_draft_tokens_total", "ngram"): 4 * n,
        ("batchinfer_spec_draft_tokens_total", "prediction"): 2 * n,
        ("batchinfer_spec_accepted_tokens_total", "ngram"): 3 * n,
        ("batchinfer_spec_accepted_tokens_total", "prediction"): 0,
        ("batchinfer_spec_steps_total", ""): n, ("batchinfer_spec_disabled_steps_total", ""): 0}


def test_a_worker_without_speculation_shows_no_spec_column(redis_server):
    r = redis_server.client()
    _job(r, "jns", 2)
    worker = Running(r, EchoEngine(max_num_seqs=4))
    wait_until(lambda: len(_rows(r, "jns")) == 2, what="2 rows")
    (view,) = wait_until(lambda: [w for w in snapshot_from_redis(r, KEYS).workers
                                  if w.extra.get("requests_done") == 2], what="a heartbeat after the rows")
    assert (view.spec_acceptance, view.spec_accepted_len) == (None, None)
    assert "spec" not in render_to_text(snapshot_from_redis(r, KEYS), width=160)
    assert worker.stop() == 0
    assert spec_samples(worker.daemon.metrics) == {}
