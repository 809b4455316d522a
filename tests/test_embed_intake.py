"""The scheduler's intake of embeddings requests (issue 14), against a real redis-server and the
tiny BERT's registered tokenizer: tokenisation identical to the embedding engine's, the model's
checks (context, truncation, vocabulary, ``dimensions``), routing by task, and packing by tokens."""

from __future__ import annotations

import json

import pytest

from batchinfer.config import Settings
from batchinfer.keys import Keys
from batchinfer.protocol.entries import IntakeEntry
from batchinfer.protocol.rows import BatchRequest, ResultRow
from batchinfer.scheduler.daemon import SchedulerDaemon
from batchinfer.store.jobstore import JobStore
from batchinfer.store.registry import Registry, fingerprint
from batchinfer.workers.engine_config import EngineConfig
from batchinfer.workers.text.tokenizer_files import read_tokenizer_files

KEYS = Keys("{emb}")
CONTEXT = 32
CAP = {"max_model_len": CONTEXT, "max_num_seqs": 64, "max_num_batched_tokens": 64, "kv_tokens": 4096}
LONG = "embeddings map sentences to vectors and similar sentences get nearby vectors " * 3


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    from tiny_embedders import make_tiny_embedding_model

    return make_tiny_embedding_model(tmp_path_factory.mktemp("models") / "tiny-bert")


@pytest.fixture(scope="module")
def engine(bert):
    from batchinfer.workers.engine.embedder import EmbeddingEngine

    return EmbeddingEngine(EngineConfig(model=str(bert), device="cpu"))


@pytest.fixture
def env(redis_server, bert, tiny_llama):
    r = redis_server.client()
    registry = Registry(r, KEYS)
    files = read_tokenizer_files(bert)
    registry.register_model("bert", files, CAP, task="embed", embedding_dim=64)
    registry.register_model("mat", files, CAP, task="embed", embedding_dim=64, matryoshka=True)
    registry.register_model("tiny", read_tokenizer_files(tiny_llama), CAP)
    for model in ("bert", "mat", "tiny"):
        registry.heartbeat_worker(f"w-{model}", {"model": model, "capacity": CAP}, ttl=60)
    return r, registry


def engine_ids(engine, texts: list[str]) -> list[list[int]]:
    """The token ids the embedding engine runs for ``texts`` (its output's prompt_token_ids)."""
    engine.add_request("probe", inputs=texts)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    (out,) = outs
    return out.prompt_token_ids


def run(r, job: str, model: str, bodies: list) -> tuple[dict[int, BatchRequest], dict[int, ResultRow]]:
    """Submit ``bodies`` as job ``job`` (line = idx + 1), run the scheduler until idle; the staged
    and batched requests and the error rows, by idx."""
    JobStore(r, KEYS).create(job, model=model)
    for i, body in enumerate(bodies):
        r.xadd(KEYS.requests, IntakeEntry(body=json.dumps(body), job_id=job, idx=i, line=i + 1).to_fields())
    sched = SchedulerDaemon(r, Settings(prefix="{emb}"), direct_hold_s=600)
    sched.dispatcher.jobs.ttl = sched.admission.jobs.ttl = 0
    for _ in range(20):
        if sched.run_once() == 0:
            break
    requests = {q["idx"]: BatchRequest.from_dict(q) for _, f in r.xrange(KEYS.batches(model))
                for q in json.loads(f[b"requests"]) if q["job_id"] == job}
    rows = {row.idx: row for row in (ResultRow.from_json(f[b"row"]) for _, f in r.xrange(KEYS.results(job)))}
    return requests, rows


def test_texts_are_tokenised_as_the_engine_does_and_staged_as_embed_requests(env, engine):
    r, _ = env
    texts = ["Hello world", "Café, naïve and résumé are words too.", "a"]
    line = {"custom_id": "o", "method": "POST", "url": "/v1/embeddings",
            "body": {"model": "ignored", "input": texts, "encoding_format": "base64"}}
    got, rows = run(r, "j", "bert", [{"input": texts[0]}, line, {"input": [[5, 6, 7], [8]]}])
    assert rows == {}
    assert got[0].inputs == engine_ids(engine, texts[:1])
    assert got[1].inputs == engine_ids(engine, texts)  # one input per element, in order
    assert got[2].inputs == [[5, 6, 7], [8]]
    for q in got.values():
        assert q.task == "embed" and q.prompt_token_ids == [] and q.sampling_params == {}
        assert q.model == "bert"
    assert got[1].url == "/v1/embeddings" and got[1].custom_id == "o"
    assert got[1].pooling_params == {"dimensions": None, "normalize": None, "pooling_type": None,
                                     "truncate_prompt_tokens": None, "encoding_format": "base64"}
    assert got[1].num_prompt_tokens == sum(len(ids) for ids in got[1].inputs)


def test_the_models_checks_become_error_rows_with_line_numbers(env, engine):
    r, _ = env
    long_ids = engine_ids(engine, [LONG])[0]
    assert len(long_ids) > CONTEXT
    bodies = [
        {"input": "fine"},                                        # 0 ok
        {"input": LONG},                                          # 1 too long
        {"input": ["short", LONG]},                               # 2 the second too long
        {"input": "x", "dimensions": 16},                         # 3 not a Matryoshka model
        {"input": "x", "dimensions": 65},                         # 4 wider than the model
        {"input": [[5, 10**6]]},                                  # 5 outside the vocabulary
        {"input": "x", "truncate_prompt_tokens": CONTEXT + 1},    # 6 truncation past the context
        {"input": [7] * (CONTEXT + 1)},                           # 7 token ids too long
        {"prompt": "generate please", "max_tokens": 2},          # 8 generation on an embedding model
        {"messages": [{"role": "user", "content": "hi"}]},       # 9 chat on an embedding model
    ]
    got, rows = run(r, "j", "bert", bodies)
    assert set(got) == {0} and set(rows) == set(range(1, 10))
    assert {i: row.line for i, row in rows.items()} == {i: i + 1 for i in range(1, 10)}
    n = len(long_ids)
    expect = {
        1: ("prompt_too_long", f"input[0] has {n} tokens, more than the model's context of {CONTEXT}"),
        2: ("prompt_too_long", f"input[1] has {n} tokens, more than the model's context of {CONTEXT}"),
        3: ("invalid_request", "model 'bert' does not support Matryoshka truncation (dimensions)"),
        4: ("invalid_request", "dimensions is 65, more than model 'bert''s embedding width of 64"),
        5: ("invalid_request", "token id 1000000 is outside the model's vocabulary"),
        6: ("invalid_request", f"truncate_prompt_tokens is {CONTEXT + 1}, more than the model's context"),
        7: ("prompt_too_long", f"input[0] has {CONTEXT + 1} tokens, more than the model's context"),
        8: ("invalid_request", "model 'bert' is an embedding model; a prompt needs a generation model"),
        9: ("invalid_request", "model 'bert' is an embedding model; chat messages needs a generation model"),
    }
    for i, (code, words) in expect.items():
        assert rows[i].error_code == code and words in (rows[i].error_message or ""), (i, rows[i])
    assert "truncate_prompt_tokens" in (rows[1].error_message or "")  # says how to get past it
    assert "input[0][1]" in (rows[5].error_message or "")
    assert JobStore(r, KEYS).get("j").failed == 9


def test_truncation_keeps_the_last_tokens_and_the_special_tokens(env, engine):
    r, _ = env
    full = engine_ids(engine, [LONG])[0]  # [CLS] ... [SEP]
    got, rows = run(r, "j", "bert", [{"input": LONG, "truncate_prompt_tokens": 10},
                                     {"input": [[1, 2, 3, 4, 5]], "truncate_prompt_tokens": 2}])
    assert rows == {}
    assert got[0].inputs == [full[:1] + full[-9:-1] + full[-1:]]  # CLS, the last 8 words' tokens, SEP
    assert got[1].inputs == [[4, 5]]  # token ids: the last N as given
    assert got[0].pooling_params["truncate_prompt_tokens"] == 10


def test_dimensions_within_a_matryoshka_models_width_pass(env):
    r, _ = env
    got, rows = run(r, "j", "mat", [{"input": "x", "dimensions": 16}, {"input": "x", "dimensions": 64},
                                    {"input": "x", "dimensions": 65}])
    assert set(got) == {0, 1} and got[0].pooling_params["dimensions"] == 16
    assert rows[2].error_code == "invalid_request" and "width of 64" in (rows[2].error_message or "")


def test_an_embeddings_line_for_a_generation_model_is_an_error_row(env):
    r, _ = env
    line = {"custom_id": "e", "method": "POST", "url": "/v1/embeddings", "body": {"model": "x", "input": "a"}}
    got, rows = run(r, "g", "tiny", [line, {"input": ["a", "b"]}, {"prompt": "fine", "max_tokens": 2}])
    assert set(got) == {2} and got[2].task == "generate"
    for i in (0, 1):
        assert rows[i].error_code == "invalid_request" and rows[i].line == i + 1
        assert rows[i].error_message == ("model 'tiny' is a generation model; /v1/embeddings needs "
                                         "an embedding model")
    assert rows[0].custom_id == "e" and rows[0].url == "/v1/embeddings"


def test_embed_requests_pack_by_their_tokens(env):
    r, registry = env
    small = {**CAP, "kv_tokens": 20, "max_num_seqs": 8}  # 20 tokens a batch: two 8-token requests
    registry.heartbeat_worker("w-bert", {"model": "bert", "capacity": small}, ttl=60)
    run(r, "j", "bert", [{"input": [[9] * 8]} for _ in range(3)] + [{"input": [[9] * 4, [9] * 4]}])
    sizes = [[sum(len(ids) for ids in q["inputs"]) for q in json.loads(f[b"requests"])]
             for _, f in r.xrange(KEYS.batches("bert"))]
    assert sorted(sum(s) for s in sizes) == [16, 16] and all(sum(s) <= 20 for s in sizes), sizes


def test_a_registration_carries_its_task(env, bert):
    r, registry = env
    info = registry.get_model("mat")
    assert (info.task, info.embedding_dim, info.matryoshka) == ("embed", 64, True)
    plain = registry.get_model("tiny")
    assert (plain.task, plain.embedding_dim, plain.matryoshka) == ("generate", None, False)
    files = read_tokenizer_files(bert)
    # a generation model's fingerprint is its files' (as before tasks existed); the task changes it
    assert plain.fingerprint == fingerprint(plain.files)
    assert registry.get_model("bert").fingerprint != fingerprint(files)
    r.hdel(KEYS.model("tiny"), "task")  # a registration written before tasks existed
    assert registry.get_model("tiny").task == "generate"
    with pytest.raises(ValueError, match="embedding_dim"):
        registry.register_model("bad", files, CAP, task="embed")
    with pytest.raises(ValueError, match="task must be one of"):
        registry.register_model("bad", files, CAP, task="classify")
