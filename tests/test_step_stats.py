"""``WorkerEngine.step_stats`` and the metrics built from it (issue 16: the worker runs ``final_only``).

Each engine's first-token events and generated-token counts are checked against what its
cumulative outputs show step by step; ``WorkerMetrics.step_done(stats=...)`` must give the
figures the cumulative path gives; a worker daemon submits its requests ``final_only`` and its
metrics still add up to its rows.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from daemons import ThreadedWorker, wait_until, worker_daemon

from batchinfer.config import Settings
from batchinfer.keys import WORKERS_GROUP, Keys
from batchinfer.ops.metrics import WorkerMetrics
from batchinfer.protocol.rows import BatchRequest
from batchinfer.store.jobstore import JobStore
from batchinfer.workers.engine.engine import Engine
from batchinfer.workers.engine.outputs import CompletionOutput, FirstToken, RequestOutput, StepStats
from batchinfer.workers.sampling_params import SamplingParams
from batchinfer.workers.service.echo_engine import EchoEngine

LONG = list(range(3, 43))  # 40 tokens: two full KV blocks, prefilled in chunks of a 32-token step
REQUESTS = {  # request id -> (prompt, sampling parameters)
    "long": (LONG, {"max_tokens": 5, "temperature": 0.0, "ignore_eos": True}),
    "pair": ([5, 6, 7], {"n": 2, "max_tokens": 4, "temperature": 0.8, "seed": 1, "ignore_eos": True}),
    "one": ([8, 9, 10], {"max_tokens": 1, "temperature": 0.0}),  # first token and finish in one step
    "cut": ([11, 12], {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}),  # aborted after its first
}
LATE = {"again": (LONG, {"max_tokens": 3, "temperature": 0.0, "ignore_eos": True})}  # prefix-cache hits


def _drive(engine: Engine, output_kind: str, abort: bool = True) -> list[tuple[list[FirstToken], int,
                                                                                 list[RequestOutput], float,
                                                                                 float]]:
    """Step until idle; per step (first tokens, generated tokens, outputs, time before, time after).
    ``cut`` is aborted in the step after its first token; ``again`` is added once ``long`` ends."""
    def add(requests: dict) -> None:
        for rid, (prompt, params) in requests.items():
            engine.add_request(rid, prompt_token_ids=prompt,
                               sampling_params=SamplingParams(**params, output_kind=output_kind))

    add(REQUESTS if abort else {k: v for k, v in REQUESTS.items() if k != "cut"})
    steps, late, cut = [], False, not abort
    while engine.has_unfinished():
        before = time.monotonic()
        outputs = engine.step()
        stats = engine.step_stats
        steps.append((stats.first_tokens, stats.num_generated_tokens, outputs, before, time.monotonic()))
        if not cut and any(f.request_id == "cut" for f in stats.first_tokens):
            engine.abort("cut")
            cut = True
        if not late and any(o.request_id == "long" and o.finished for o in outputs):
            add(LATE)
            late = True
    return steps


def test_engine_step_stats_match_its_cumulative_outputs(engine_factory):
    steps = _drive(engine_factory(max_num_batched_tokens=32, max_num_seqs=8), "cumulative")
    seen: dict[str, int] = {}  # request id -> tokens its outputs showed so far
    first_step: dict[str, int] = {}
    finals: dict[str, RequestOutput] = {}
    for i, (firsts, generated, outputs, before, after) in enumerate(steps):
        delta = 0
        for out in outputs:
            total = sum(len(c.token_ids) for c in out.outputs)
            if total and not seen.get(out.request_id):
                first_step[out.request_id] = i
            delta += total - seen.get(out.request_id, 0)
            seen[out.request_id] = total
            if out.finished:
                finals[out.request_id] = out
        assert generated == delta, f"step {i}"
        assert all(before <= f.time <= after for f in firsts)
        for f in firsts:
            assert first_step[f.request_id] == i
    events = [f for firsts, *_ in steps for f in firsts]
    assert sorted(f.request_id for f in events) == sorted(first_step) == sorted([*REQUESTS, *LATE])
    for f in events:
        out = finals[f.request_id]
        assert f.num_prompt_tokens == len(out.prompt_token_ids)
        assert f.num_cached_tokens == out.num_cached_tokens
    by_id = {f.request_id: f for f in events}
    assert by_id["again"].num_cached_tokens > 0 and by_id["long"].num_cached_tokens == 0
    assert first_step["long"] > 0  # its prefill took more than one step
    assert finals["cut"].outputs[0].finish_reason == "abort"
    assert sum(g for _, g, *_ in steps) == sum(seen.values())


def test_final_only_requests_give_the_same_stats_and_only_final_outputs(engine_factory):
    make = lambda: engine_factory(max_num_batched_tokens=32, max_num_seqs=8)  # noqa: E731
    engines = {kind: make() for kind in ("cumulative", "final_only")}
    runs = {kind: _drive(engine, kind) for kind, engine in engines.items()}

    def summary(steps) -> list:
        return [([f[:3] for f in firsts], generated) for firsts, generated, *_ in steps]

    assert summary(runs["final_only"]) == summary(runs["cumulative"])
    assert engines["final_only"].num_generated_tokens == engines["cumulative"].num_generated_tokens
    finals = [o for *_, outputs, _, _ in runs["final_only"] for o in outputs]
    assert all(o.finished for o in finals)
    assert sorted(o.request_id for o in finals) == sorted([*REQUESTS, *LATE])
    cumulative = {o.request_id: o for *_, outputs, _, _ in runs["cumulative"] for o in outputs if o.finished}
    assert {o.request_id: [c.token_ids for c in o.outputs] for o in finals} == \
           {rid: [c.token_ids for c in o.outputs] for rid, o in cumulative.items()}


def test_an_idle_step_reports_nothing_and_each_step_has_fresh_stats(engine_factory):
    engine = engine_factory()
    engine.step()
    assert engine.step_stats == StepStats()
    engine.add_request("a", prompt_token_ids=[5, 6], sampling_params={"max_tokens": 2, "temperature": 0.0,
                                                                      "ignore_eos": True})
    engine.step()
    first = engine.step_stats
    assert [f.request_id for f in first.first_tokens] == ["a"] and first.num_generated_tokens == 1
    engine.step()
    assert engine.step_stats is not first and engine.step_stats.first_tokens == []
    assert engine.step_stats.num_generated_tokens == 1 and not engine.has_unfinished()


def test_echo_engine_step_stats():
    e = EchoEngine(requests_per_step=2)
    e.add_request("a", prompt_token_ids=[104, 105, 106], sampling_params={"max_tokens": 2})
    e.add_request("b", prompt_token_ids=[104, 105],
                  sampling_params={"max_tokens": 5, "min_tokens": 5, "n": 2})
    e.add_request("c", prompt_token_ids=[1, 2])
    e.step()
    assert [f[:3] for f in e.step_stats.first_tokens] == [("a", 3, 0), ("b", 2, 0)]
    assert e.step_stats.num_generated_tokens == 2 + 5 * 2 == e.num_generated_tokens
    e.abort("c")
    (aborted,) = e.step()
    assert aborted.outputs[0].finish_reason == "abort" and e.step_stats == StepStats()


# -- metrics ----------------------------------------------------------------------------------------


def _out(request_id: str, prompt: int, tokens: int, *, reason: str = "length",
         cached: int = 0) -> RequestOutput:
    completion = CompletionOutput(0, token_ids=list(range(tokens)), finish_reason=reason)
    return RequestOutput(request_id, list(range(prompt)), [completion], num_cached_tokens=cached,
                         finished=True)


def _count(histogram) -> float:
    """A histogram child's observation count (the sum of its buckets)."""
    return sum(b.get() for b in histogram._buckets)


def _stats(generated: int, *firsts: tuple[str, int, int]) -> StepStats:
    return StepStats([FirstToken(rid, prompt, cached, 0.0) for rid, prompt, cached in firsts], generated)


def test_step_stats_time_first_tokens_and_count_tokens_as_the_cumulative_path():
    # tests/test_metrics.py's scripted steps, through the stats path: final outputs only
    clock = [100.0]
    m = WorkerMetrics("m", clock=lambda: clock[0])
    m.request_started("a")
    m.request_started("b")
    clock[0] = 101.0
    m.step_done([], seconds=1.0, stats=_stats(1, ("a", 6, 2)))  # b still in chunked prefill
    clock[0] = 103.0
    m.step_done([], seconds=2.0, stats=_stats(2, ("b", 4, 0)))
    clock[0] = 104.0
    m.step_done([_out("a", 6, 3, cached=2), _out("b", 4, 1, reason="abort")], seconds=1.0, stats=_stats(1))
    assert m.prompt_tokens._value.get() == 10
    assert m.generation_tokens._value.get() == 3 + 1
    assert m.ttft._sum.get() == pytest.approx(1.0 + 3.0) and _count(m.ttft) == 2
    assert m.inference._sum.get() == pytest.approx(4.0)  # only a: b was aborted
    assert m.step_tokens._sum.get() == 5 + 6 + 1
    assert m.heartbeat_fields()["tokens_per_s"] == pytest.approx((10 + 4) / 4, abs=0.05)
    assert m._inflight == {}


def test_a_cancelled_request_counts_its_tokens_once():
    m = WorkerMetrics("m")
    m.request_started("c")
    m.step_done([], seconds=0.1, stats=_stats(1, ("c", 5, 0)))
    m.step_done([], seconds=0.1, stats=_stats(1))
    m.request_aborted("c")  # the daemon's _abort, then the engine's abort output with the next step
    m.step_done([_out("c", 5, 2, reason="abort")], seconds=0.1, stats=_stats(0))
    assert (m.prompt_tokens._value.get(), m.generation_tokens._value.get()) == (5, 2)
    assert _count(m.ttft) == 1 and _count(m.inference) == 0


def test_an_engine_run_gives_the_same_metrics_through_stats_as_through_cumulative_outputs(engine_factory):
    # No abort here: the cumulative path counts an aborted request's output again when it comes
    # after request_aborted (it is no longer in flight), which the stats path does not.
    steps = _drive(engine_factory(max_num_batched_tokens=32, max_num_seqs=8), "cumulative", abort=False)
    clock = [0.0]
    old, new = (WorkerMetrics("m", clock=lambda: clock[0]) for _ in range(2))
    for m in (old, new):
        for rid in [*REQUESTS, *LATE]:
            m.request_started(rid)
    for i, (firsts, generated, outputs, _, _) in enumerate(steps):
        clock[0] = i + 1.0
        old.step_done(outputs, seconds=1.0)
        new.step_done([o for o in outputs if o.finished], seconds=1.0, stats=StepStats(firsts, generated))
    for name in ("prompt_tokens", "generation_tokens"):
        assert getattr(new, name)._value.get() == getattr(old, name)._value.get() > 0, name
    for name in ("ttft", "inference", "step_tokens", "step_seconds"):
        assert (getattr(new, name)._sum.get(), _count(getattr(new, name))) == \
               (getattr(old, name)._sum.get(), _count(getattr(old, name))), name
    assert _count(new.ttft) == len(REQUESTS) - 1 + len(LATE)


# -- the worker daemon --------------------------------------------------------------------------------

PREFIX = "{ss}"
KEYS = Keys(PREFIX)


class RecordingEngine(Engine):
    """The real engine, recording each request's output kind and whether a step returned a
    non-final output."""

    kinds: list[str]
    unfinished_outputs: int

    def add_request(self, request_id, prompt=None, prompt_token_ids=None, sampling_params=None, *,
                    lora=None, spec_group=None, arrival_time=None):
        assert isinstance(sampling_params, SamplingParams)
        self.kinds.append(sampling_params.output_kind)
        super().add_request(request_id, prompt, prompt_token_ids, sampling_params, lora=lora,
                            spec_group=spec_group, arrival_time=arrival_time)

    def step(self):
        outputs = super().step()
        self.unfinished_outputs += sum(not o.finished for o in outputs)
        return outputs


def test_the_worker_runs_final_only_and_its_metrics_add_up_to_its_rows(redis_server, tiny_llama):
    engine = RecordingEngine.from_model(tiny_llama, num_kv_blocks=64, max_num_seqs=4,
                                        max_num_batched_tokens=32)
    engine.kinds, engine.unfinished_outputs = [], 0
    r = redis_server.client()
    model = Path(tiny_llama).name
    JobStore(r, KEYS).create("jf", model=model)
    prompts = [LONG, [5, 6, 7, 8], [9, 10], LONG, [11, 12, 13], [14]]
    reqs = [BatchRequest(request_id=f"jf:{i}", job_id="jf", idx=i, prompt_token_ids=p, model=model,
                         sampling_params={"max_tokens": 3 + i, "temperature": 0.0, "ignore_eos": True,
                                          **({"n": 2, "temperature": 0.7, "seed": 3} if i == 2 else {})},
                         line=i + 1, created_at=1)
            for i, p in enumerate(prompts)]
    r.xgroup_create(KEYS.batches(model), WORKERS_GROUP, id="0", mkstream=True)
    for batch in (reqs[:3], reqs[3:]):
        r.xadd(KEYS.batches(model), {"v": "1", "requests": json.dumps([q.to_dict() for q in batch])})
    worker = ThreadedWorker(worker_daemon(r, Settings(prefix=PREFIX, heartbeat_seconds=0.3), engine, "wf"))
    wait_until(lambda: r.xlen(KEYS.results("jf")) == len(reqs), timeout=120)
    assert worker.stop() == 0
    rows = [json.loads(f[b"row"]) for _, f in r.xrange(KEYS.results("jf"))]
    assert all(x["status"] == "completed" for x in rows)
    assert engine.kinds == ["final_only"] * len(reqs) and engine.unfinished_outputs == 0
    m = worker.daemon.metrics
    assert m.prompt_tokens._value.get() == sum(x["prompt_tokens"] for x in rows)
    assert m.generation_tokens._value.get() == sum(x["completion_tokens"] for x in rows) == \
           engine.num_generated_tokens
    ttft, inference = m.ttft, m.inference
    assert _count(ttft) == _count(inference) == len(reqs)
    assert 0 < ttft._sum.get() <= inference._sum.get()
    assert m.step_tokens._sum.get() == engine.num_computed_tokens
    assert m._inflight == {}
