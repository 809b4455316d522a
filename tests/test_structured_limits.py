"""Structured specs the scheduler accepts and the worker cannot run (issue 27 item 5), through the real
scheduler intake and a worker daemon with the real tiny engine, on a real redis-server.

The scheduler compiles each spec with the workers' limits and runs it through its first tokens, so
`(x{1000}){1000}` (out of lexer fuel) and a Lark rule of 3,000 alternatives (a parser row over its
2,000 items) are ``invalid_request`` rows at intake, naming the body's field. Any spec that still
reaches a worker (another backend, a hand-written batch entry, a failure further into the decode)
costs that request its ``invalid_request`` row at once, from the worker: never a retry, an attempt,
a dead letter or an ``engine_error``, and never anything to the other requests of its batch.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from daemons import CLI, ThreadedWorker, serve_tiny, wait_until, worker_daemon

from batchinfer.cli.context import EXIT_STARTUP
from batchinfer.config import Settings
from batchinfer.keys import SCHEDULER_GROUP, WORKERS_GROUP, Keys
from batchinfer.protocol.rows import BatchRequest, ResultRow
from batchinfer.scheduler.daemon import SchedulerDaemon
from batchinfer.store.jobstore import JobStore
from batchinfer.workers.text.tokenizer_files import read_tokenizer_files

PREFIX = "{sw}"
KEYS = Keys(PREFIX)
LARK_3000 = "start: " + " | ".join(f'"w{i}"' for i in range(3000)) + "\n"
DFA_HEAVY = "(x{1000}){1000}"
CAP = {"max_model_len": 128, "max_num_seqs": 4, "max_num_batched_tokens": 256, "kv_tokens": 4096}


def test_the_scheduler_intake_answers_specs_no_worker_can_decode_with_invalid_request(redis_server,
                                                                                        tiny_llama):
    r = redis_server.client()
    serve_tiny(r, KEYS, read_tokenizer_files(tiny_llama), CAP)
    JobStore(r, KEYS).create("j", model="tiny")
    bodies = [{"prompt": "hi", "guided_regex": DFA_HEAVY},
              {"prompt": "hi", "structured_outputs": {"grammar": LARK_3000}},
              {"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {
                  "name": "s", "schema": {"type": "string", "pattern": f"^{DFA_HEAVY}$"}}}},
              {"prompt": "hi", "guided_regex": "x{100}[a-z]{3}"}]
    for i, body in enumerate(bodies):
        r.xadd(KEYS.requests, {"v": "1", "job": "j", "idx": str(i),
                               "body": json.dumps({"model": "tiny", "max_tokens": 4, **body})})
    sched = SchedulerDaemon(r, Settings(prefix=PREFIX), direct_hold_s=600)
    for _ in range(10):
        if sched.run_once() == 0:
            break
    assert r.xlen(KEYS.requests) == 0 and r.xpending(KEYS.requests, SCHEDULER_GROUP)["pending"] == 0
    got = {row.idx: row for row in (ResultRow.from_json(f[b"row"]) for _, f in r.xrange(KEYS.results("j")))}
    for idx, field, says in ((0, "guided_regex", "too many expressions"),
                             (1, "structured_outputs.grammar", "3001 items"),
                             (2, "response_format.json_schema.schema", "too many expressions")):
        row = got.pop(idx)
        assert (row.status, row.error_code) == ("failed", "invalid_request"), row
        assert row.error_message.startswith(f"{field}: it fails on its first tokens: "), row.error_message
        assert says in row.error_message
    assert got == {}  # the good spec: no row, but dispatched (staged) for a worker
    staged = [q for _, f in r.xrange(KEYS.batches("tiny")) for q in json.loads(f[b"requests"])]
    for member in r.zrange(KEYS.queues("tiny"), 0, -1):
        staged += [json.loads(g[b"req"]) for _, g in r.xrange(KEYS.queue("tiny", member.decode()))]
    assert [q["idx"] for q in staged] == [3]


def _request(job: str, idx: int, model: str, **params) -> BatchRequest:
    return BatchRequest(request_id=f"{job}:{idx}", job_id=job, idx=idx, prompt_token_ids=[5, 6, 7, 8],
                        sampling_params={"max_tokens": 12, "temperature": 0.0, **params}, model=model,
                        line=idx + 1, custom_id=f"c{idx}", created_at=1)


def test_a_grammar_failing_mid_decode_is_its_requests_invalid_request_row_and_never_retried(
        redis_server, tiny_llama):
    from batchinfer.workers.engine.engine import Engine

    r = redis_server.client()
    model = Path(tiny_llama).name
    JobStore(r, KEYS).create("js", model=model)
    reqs = [_request("js", 0, model, structured_outputs={"regex": "(x{1000}){1000}"}),
            _request("js", 1, model, structured_outputs={"grammar": LARK_3000}),
            _request("js", 2, model, structured_outputs={"choice": ["yes", "no"]}),
            _request("js", 3, model, ignore_eos=True)]
    r.xgroup_create(KEYS.batches(model), WORKERS_GROUP, id="0", mkstream=True)
    r.xadd(KEYS.batches(model), {"v": "1", "requests": json.dumps([q.to_dict() for q in reqs])})
    engine = Engine.from_model(tiny_llama, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=64)
    worker = ThreadedWorker(worker_daemon(r, Settings(prefix=PREFIX, heartbeat_seconds=0.3, max_attempts=3),
                                          engine, "ws"))

    def rows() -> dict[int, dict]:
        return {x["idx"]: x for x in (json.loads(f[b"row"]) for _, f in r.xrange(KEYS.results("js")))}

    wait_until(lambda: len(rows()) == 4, timeout=120, what="4 rows")
    wait_until(lambda: r.xpending(KEYS.batches(model), WORKERS_GROUP)["pending"] == 0, what="the batch acked")
    assert worker.stop() == 0
    got = rows()
    for idx, says in ((0, "too many expressions"), (1, "3001 items")):
        row = got[idx]
        assert (row["status"], row["error_code"]) == ("failed", "invalid_request"), row
        assert row["error_message"].startswith("structured_outputs: ") and says in row["error_message"]
    assert got[2]["status"] == "completed" and got[2]["output_text"] in ("yes", "no")
    assert got[3]["status"] == "completed" and got[3]["finish_reason"] == "length"
    assert len(r.xrange(KEYS.results("js"))) == 4  # one row each: nothing went back for another try
    # no attempt counted (a retry writes one with its retry batch), no dead letter
    assert r.hgetall(KEYS.attempts("js")) == {} and r.xlen(KEYS.deadletter) == 0


@pytest.mark.parametrize(("env", "options", "says"), [
    ({"BATCHINFER_STRUCTURED_LEXER_FUEL": "0"}, [], "lexer_fuel must be a positive integer, got 0"),
    ({}, ["--engine-option", 'structured_limits={"lexer_fule": 1}'], "unknown limit(s) lexer_fule"),
])
def test_a_worker_reads_the_structured_limits_and_refuses_a_bad_one_at_start(tiny_llama, tmp_path, env,
                                                                             options, says):
    """The worker builds its engine's limits from the scheduler's settings (so it checks them): a bad
    one stops it before it registers, naming the setting."""
    done = subprocess.run([*CLI, "worker", "--model", str(tiny_llama), *options], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path, env={**os.environ, **env})
    assert done.returncode == EXIT_STARTUP, (done.stdout, done.stderr)
    assert "BATCHINFER_STRUCTURED_*" in done.stderr and says in done.stderr, done.stderr
