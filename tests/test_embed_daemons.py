"""Embeddings through the real daemons (issue 14): scheduler, exporter and workers as subprocesses
(``batchinfer worker --model DIR`` on the tiny BERT of ``make_tiny_embedding_model``).

- a job with good and bad embeddings lines: exactly one row per line; the vectors are those of
  ``LLM.embed`` on the same texts; a list input gives one vector per element, in order;
- a worker SIGKILLed mid-job: after its restart every line has exactly one row;
- a job mixing embeddings and chat lines for two models served by two workers (an embedding worker
  and a generation worker): each line is answered by the right one, a line for the wrong kind of
  model is an error row;
- in-process (``ThreadedWorker``): the worker registers its task, and a request of the wrong task
  or one its engine refuses, written straight to a batch stream, is an error row, never a crash;
  a failing step is bisected to the one request behind it; a cancel aborts running and waiting
  embedding requests.
"""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
from daemons import (
    FAULT_ENV,
    Stack,
    ThreadedWorker,
    assert_exactly_once,
    pending_of,
    stream_rows,
    wait_until,
    worker_daemon,
)

from batchinfer.config import Settings
from batchinfer.keys import WORKERS_GROUP, Keys
from batchinfer.protocol.rows import BatchRequest, ResultRow
from batchinfer.redis_conn import ensure_group
from batchinfer.store.jobstore import JobStore
from batchinfer.store.registry import Registry
from batchinfer.workers.engine_config import EngineConfig
from batchinfer.workers.service.echo_engine import EchoEngine

pytestmark = pytest.mark.timeout(300)

LONG = "embeddings map sentences to vectors and similar sentences get nearby vectors " * 30  # > 256 tokens


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    from tiny_embedders import make_tiny_embedding_model

    return make_tiny_embedding_model(tmp_path_factory.mktemp("models") / "tiny-bert")


@pytest.fixture
def stack(redis_server, tmp_path):
    s = Stack(redis_server.url, tmp_path, env=FAULT_ENV)
    yield s
    s.close()


def reference(bert, texts: list[str]) -> tuple[list[list[float]], list[int]]:
    """``LLM.embed``'s vectors of ``texts`` and their token counts (the in-process API, same folder)."""
    from batchinfer.workers.entrypoints.llm import LLM

    outs = LLM(bert).embed(texts)
    return [out.outputs.embedding for out in outs], [len(out.prompt_token_ids) for out in outs]


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def by_idx(stack: Stack, job: str) -> dict[int, ResultRow]:
    rows = stream_rows(stack, job)
    counts = Counter(r["idx"] for r in rows)
    assert all(c == 1 for c in counts.values()), counts
    return {r["idx"]: ResultRow.from_dict(r) for r in rows}


def test_an_embeddings_job_has_one_row_per_line_and_llm_embeds_vectors(stack, bert):
    stack.start("scheduler", "scheduler")
    stack.start("exporter", "exporter")
    stack.worker("e1", bert)
    stack.wait_for_worker("e1")
    texts = ["A cat sits on the mat.", "Search engines compare vectors.", "Yes: often!"]
    lines = [
        {"custom_id": "one", "input": texts[0]},
        {"custom_id": "list", "input": texts},
        {"custom_id": "empty", "input": ""},
        {"custom_id": "long", "input": LONG},
        {"custom_id": "oa", "method": "POST", "url": "/v1/embeddings",
         "body": {"model": "text-embedding-3-small", "input": texts[1], "encoding_format": "base64"}},
        {"custom_id": "dims", "input": "x", "dimensions": 8},
        {"custom_id": "chat", "messages": [{"role": "user", "content": "hi"}]},
        {"custom_id": "sampled", "input": "x", "max_tokens": 3},
        {"custom_id": "trunc", "input": LONG, "truncate_prompt_tokens": 20},
    ]
    job = stack.client.submit(lines, model="tiny-bert")
    record = stack.wait(job)
    assert record.status.value == "completed", (record, stack.logs())
    assert_exactly_once(stack, job, len(lines), record)
    rows = by_idx(stack, job)
    errors = {i: (r.error_code, r.line) for i, r in rows.items() if not r.ok}
    assert errors == {2: ("invalid_request", 3), 3: ("prompt_too_long", 4), 5: ("invalid_request", 6),
                      6: ("invalid_request", 7), 7: ("invalid_request", 8)}, rows
    assert "input must not be an empty string" in (rows[2].error_message or "")
    assert "more than the model's context of 256" in (rows[3].error_message or "")
    assert "Matryoshka" in (rows[5].error_message or "")
    assert "is an embedding model" in (rows[6].error_message or "")
    assert "max_tokens is a sampling parameter" in (rows[7].error_message or "")

    want, counts = reference(bert, texts)
    got = {i: r.vectors() for i, r in rows.items() if r.ok}
    assert [len(v) for v in got[1] or []] == [64, 64, 64]  # one vector per element, in order
    pairs = [(got[0][0], want[0]), (got[4][0], want[1])] + list(zip(got[1] or [], want, strict=True))
    worst = min(cosine(a, b) for a, b in pairs)
    assert worst >= 0.9999, worst
    assert rows[1].prompt_tokens == sum(counts) and rows[0].prompt_tokens == counts[0]
    assert rows[4].custom_id == "oa" and rows[4].url == "/v1/embeddings"
    assert rows[4].pooling_params and rows[4].pooling_params["encoding_format"] == "base64"
    assert rows[8].ok and rows[8].prompt_tokens == 20 and rows[8].completion_tokens == 0
    assert {r.worker for r in rows.values() if r.ok} == {"e1"}


@pytest.mark.slow
def test_a_worker_killed_mid_job_loses_and_duplicates_no_row(stack, bert):
    n = 120
    stack.start("scheduler", "scheduler")
    stack.start("exporter", "exporter")
    slow = {"max_num_seqs": 2, "max_num_batched_tokens": 256}  # many small steps: the kill lands mid-job
    stack.worker("e1", bert, options=slow)
    stack.wait_for_worker("e1")
    lines = [{"custom_id": f"r{i}", "input": [f"line {i} says something about vectors {j}" for j in range(4)]}
             for i in range(n)]
    job = stack.client.submit(lines, model="tiny-bert")

    def mid_job() -> bool:
        return len(stream_rows(stack, job)) >= 5 and bool(pending_of(stack, "tiny-bert", "e1"))

    stack.until(mid_job, 120, "e1 mid-job")
    stack.kill("e1")
    assert len(stream_rows(stack, job)) < n, "the job finished before the kill: make it longer"
    stack.worker("e1", bert, options=slow)  # the same name: it takes back its own pending batches
    record = stack.wait(job, timeout=240)
    assert record.status.value == "completed", (record, stack.logs())
    rows = assert_exactly_once(stack, job, n, record)
    assert all(r["status"] == "completed" for r in rows)
    assert all(len(ResultRow.from_dict(r).vectors() or []) == 4 for r in rows)


def test_embeddings_and_chat_lines_go_to_the_right_workers(stack, bert, tiny_llama):
    stack.start("scheduler", "scheduler")
    stack.start("exporter", "exporter")
    stack.worker("embedder", bert)
    stack.worker("generator", tiny_llama)
    stack.wait_for_workers(2)
    chat = [{"role": "user", "content": "hello"}]
    lines = [
        {"custom_id": "e0", "model": "tiny-bert", "input": ["first text", "second text"]},
        {"custom_id": "g0", "model": "tiny-llama", "messages": chat, "max_tokens": 3, "temperature": 0},
        {"custom_id": "e1", "method": "POST", "url": "/v1/embeddings",
         "body": {"model": "tiny-bert", "input": "x"}},
        {"custom_id": "g1", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "tiny-llama", "messages": chat, "max_tokens": 2}},
        {"custom_id": "g2", "model": "tiny-llama", "prompt": "Once upon", "max_tokens": 2},
        {"custom_id": "bad-e", "model": "tiny-llama", "input": "x"},  # embeddings for a generation model
        {"custom_id": "bad-g", "model": "tiny-bert", "prompt": "x"},  # a prompt for an embedding model
    ]
    job = stack.client.submit(lines)
    record = stack.wait(job)
    assert record.status.value == "completed", (record, stack.logs())
    assert_exactly_once(stack, job, len(lines), record)
    rows = {r.custom_id: r for r in by_idx(stack, job).values()}
    for cid in ("e0", "e1"):
        assert rows[cid].ok and rows[cid].worker == "embedder" and rows[cid].embeddings, rows[cid]
        assert rows[cid].output_text is None
    assert len(rows["e0"].embeddings or []) == 2
    for cid in ("g0", "g1", "g2"):
        assert rows[cid].ok and rows[cid].worker == "generator" and rows[cid].embeddings is None, rows[cid]
        assert rows[cid].completion_tokens and rows[cid].completion_tokens > 0
    assert rows["bad-e"].error_code == "invalid_request" and rows["bad-e"].line == 6
    assert "model 'tiny-llama' is a generation model" in (rows["bad-e"].error_message or "")
    assert rows["bad-g"].error_code == "invalid_request" and rows["bad-g"].line == 7
    assert "model 'tiny-bert' is an embedding model" in (rows["bad-g"].error_message or "")


# -- in-process: the worker daemon with an embedding engine ------------------------------------------

KEYS = Keys("{ed}")


def _embed(idx: int, inputs: list[list[int]] | None, model: str, task: str = "embed") -> BatchRequest:
    return BatchRequest(request_id=f"j:{idx}", job_id="j", idx=idx, prompt_token_ids=[] if task == "embed"
                        else [5, 6, 7], sampling_params={} if task == "embed" else {"max_tokens": 2},
                        model=model, line=idx + 1, task=task, inputs=inputs if task == "embed" else None,
                        pooling_params={"encoding_format": "float"} if task == "embed" else None)


def _dispatch(r, model: str, requests: list[BatchRequest]) -> None:
    stream = KEYS.batches(model)
    ensure_group(r, stream, WORKERS_GROUP)  # the worker may be creating it at the same moment
    r.xadd(stream, {"v": "1", "requests": json.dumps([q.to_dict() for q in requests])})


def _rows(r) -> dict[int, ResultRow]:
    return {row.idx: row for row in (ResultRow.from_json(f[b"row"]) for _, f in r.xrange(KEYS.results("j")))}


def test_the_worker_registers_its_task_and_answers_wrong_requests_with_rows(redis_server, bert):
    from batchinfer.workers.engine.embedder import EmbeddingEngine

    r = redis_server.client()
    JobStore(r, KEYS).create("j", model="tiny-bert")
    engine = EmbeddingEngine(EngineConfig(model=str(bert), device="cpu"))
    ids = engine.tokenizer.encode("a cat sits on the mat")
    settings = Settings(prefix="{ed}", heartbeat_seconds=0.3)
    worker = ThreadedWorker(worker_daemon(r, settings, engine, "emb"))
    echo = ThreadedWorker(worker_daemon(r, settings, EchoEngine(), "gen"))
    registry = Registry(r, KEYS)
    # a worker's heartbeat can be seen a moment before its model registration
    wait_until(lambda: len(registry.live_workers()) == 2 and registry.get_model("tiny-bert") is not None
               and registry.get_model("echo") is not None, what="two workers and their models")
    info = registry.get_model("tiny-bert")
    assert (info.task, info.embedding_dim, info.matryoshka) == ("embed", 64, False)
    assert Registry(r, KEYS).get_model("echo").task == "generate"
    bert_batch = [_embed(0, [ids, ids[:3]], "tiny-bert"), _embed(1, None, "tiny-bert", "generate"),
                  _embed(2, [[5, 10**6]], "tiny-bert")]
    _dispatch(r, "tiny-bert", bert_batch)
    _dispatch(r, "echo", [_embed(3, [ids], "echo")])
    wait_until(lambda: len(_rows(r)) == 4, what="4 rows")
    rows = _rows(r)
    assert worker.stop() == 0 and echo.stop() == 0  # neither died
    assert rows[0].ok and rows[0].worker == "emb" and rows[0].prompt_tokens == len(ids) + 3
    want = [out.outputs.embedding for out in _llm(bert).embed([ids, ids[:3]])]
    assert min(cosine(a, b) for a, b in zip(rows[0].vectors() or [], want, strict=True)) >= 0.9999
    assert rows[1].error_code == "invalid_request" and rows[1].worker == "emb"
    assert rows[1].error_message == ("model 'tiny-bert' is an embedding model on worker emb; a request of "
                                     "task 'generate' cannot run on it")
    assert rows[2].error_code == "invalid_request" and "inputs[0][1] must be a token id" in (
        rows[2].error_message or "")
    assert rows[3].error_code == "invalid_request" and rows[3].error_message == (
        "model 'echo' is a generation model on worker gen; an embeddings request cannot run on it")
    assert r.xpending(KEYS.batches("tiny-bert"), WORKERS_GROUP)["pending"] == 0  # every batch acked
    metrics = worker.daemon.metrics  # pooled outputs count as prompt tokens, none generated
    assert metrics.prompt_tokens._value.get() == len(ids) + 3
    assert metrics.generation_tokens._value.get() == 0


def _llm(bert):
    from batchinfer.workers.entrypoints.llm import LLM

    return LLM(bert)


POISON = 7  # a token id whose presence in a step makes the test engine's model fail


def test_a_failing_step_is_bisected_to_the_one_embed_request_behind_it(redis_server, bert):
    from batchinfer.workers.engine.embedder import EmbeddingEngine

    class PoisonedEmbedder(EmbeddingEngine):
        """The real engine, whose model run fails for a step holding the POISON token (a fault
        hook, as the echo engine's ``poison``): the step raises without naming the request."""

        def _run(self, seqs, kinds):
            if any(POISON in s for s in seqs):
                raise RuntimeError("device fault")
            return super()._run(seqs, kinds)

    r = redis_server.client()
    JobStore(r, KEYS).create("j", model="tiny-bert")
    engine = PoisonedEmbedder(EngineConfig(model=str(bert), device="cpu"))
    settings = Settings(prefix="{ed}", heartbeat_seconds=0.3, max_attempts=2)
    worker = ThreadedWorker(worker_daemon(r, settings, engine, "emb"))
    wait_until(lambda: Registry(r, KEYS).live_workers(), what="the worker")
    inputs = [[[2, 10 + i, 3], [2, 20 + i, 3]] for i in range(6)]
    inputs[4] = [[2, 30, 3], [2, POISON, 3]]  # the second input of request 4 poisons any step it is in
    _dispatch(r, "tiny-bert", [_embed(i, x, "tiny-bert") for i, x in enumerate(inputs)])
    wait_until(lambda: len(_rows(r)) == 6, timeout=90, what="6 rows")
    rows = _rows(r)
    assert worker.stop() == 0
    assert {i for i, row in rows.items() if row.ok} == {0, 1, 2, 3, 5}
    assert rows[4].error_code == "engine_error" and "device fault" in (rows[4].error_message or "")
    assert all(len(rows[i].vectors() or []) == 2 for i in (0, 1, 2, 3, 5))
    assert len(r.xrange(KEYS.deadletter)) == 1  # only the culprit, after max_attempts tries


def test_cancelling_an_embeddings_job_aborts_its_running_and_waiting_requests(redis_server, bert):
    import time

    from batchinfer.workers.engine.embedder import EmbeddingEngine

    class SlowEmbedder(EmbeddingEngine):
        """The real engine, 50 ms a step (as the echo engine's ``step_delay``): the cancel lands mid-job."""

        def _run(self, seqs, kinds):
            time.sleep(0.05)
            return super()._run(seqs, kinds)

    r = redis_server.client()
    JobStore(r, KEYS).create("j", model="tiny-bert")
    engine = SlowEmbedder(EngineConfig(model=str(bert), device="cpu", max_num_seqs=2))
    settings = Settings(prefix="{ed}", heartbeat_seconds=0.3)
    worker = ThreadedWorker(worker_daemon(r, settings, engine, "emb", cancel_poll_seconds=0.05))
    for start in range(0, 24, 8):
        batch = [_embed(i, [[2, 10 + i, 3], [2, 11, 3]], "tiny-bert") for i in range(start, start + 8)]
        _dispatch(r, "tiny-bert", batch)
    wait_until(lambda: len(_rows(r)) >= 2, what="2 rows")
    JobStore(r, KEYS).cancel("j")
    wait_until(lambda: len(_rows(r)) == 24, what="24 rows")
    assert worker.stop() == 0
    statuses = Counter(row.status for row in _rows(r).values())
    assert statuses["completed"] >= 2 and statuses["cancelled"] >= 8, statuses
    assert all(row.error_code == "cancelled" for row in _rows(r).values() if row.status == "cancelled")
    assert not engine.has_unfinished()
    assert r.xpending(KEYS.batches("tiny-bert"), WORKERS_GROUP)["pending"] == 0
