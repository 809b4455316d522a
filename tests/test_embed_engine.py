"""``EmbeddingEngine`` through the ``WorkerEngine`` contract the worker daemon drives, and ``LLM.embed``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_embedders import make_tiny_embedding_model

from batchinfer import LLM
from batchinfer.workers.engine.embedder import EmbeddingEngine, is_embedding_model
from batchinfer.workers.engine.interface import WorkerEngine
from batchinfer.workers.engine.outputs import EmbeddingRequestOutput, PooledRequestOutput
from batchinfer.workers.models.tiny import make_tiny_model
from batchinfer.workers.pooling_params import PoolingParams


@pytest.fixture(scope="module")
def bert(tmp_path_factory) -> Path:
    return make_tiny_embedding_model(tmp_path_factory.mktemp("bert") / "bert")


@pytest.fixture(scope="module")
def matryoshka(tmp_path_factory) -> Path:
    return make_tiny_embedding_model(tmp_path_factory.mktemp("m") / "m", matryoshka_dimensions=[16, 32, 64])


def ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(5, 200, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(engine: EmbeddingEngine) -> dict[str, PooledRequestOutput]:
    done: dict[str, PooledRequestOutput] = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.finished and out.request_id not in done
            done[out.request_id] = out
    return done


def embed_alone(engine: EmbeddingEngine, tokens: list[int], **params) -> torch.Tensor:
    engine.add_request("alone", inputs=[tokens], pooling_params=params)
    return run(engine)["alone"].data[0]


def test_the_worker_engine_contract(bert: Path) -> None:
    engine = EmbeddingEngine.from_model(bert, max_num_batched_tokens=256, max_num_seqs=4)
    assert isinstance(engine, WorkerEngine)
    assert (engine.task, engine.embedding_dim, engine.matryoshka) == ("embed", 64, False)
    assert engine.model_name == "bert"
    assert engine.capacity() == {"max_model_len": 256, "max_num_seqs": 4, "max_num_batched_tokens": 256,
                                 "kv_tokens": 256}
    assert "tokenizer.json" in engine.tokenizer_files()
    assert list(engine.eos_token_ids) == [] and engine.kv_usage is None and engine.num_preemptions == 0
    assert not engine.has_unfinished() and engine.step() == []


def test_a_request_spans_steps_and_finishes_when_every_input_is_pooled(bert: Path) -> None:
    engine = EmbeddingEngine.from_model(bert, max_num_batched_tokens=256, max_num_seqs=3)
    inputs = [ids(n, seed=n) for n in (200, 8, 120, 150, 3, 9)]
    engine.add_request("multi", inputs=inputs)
    engine.add_request("single", prompt_token_ids=ids(30))
    assert engine.num_unfinished() == 2 and engine.num_running == 2
    finished_at: dict[str, int] = {}
    step = 0
    while engine.has_unfinished():
        before = engine.num_computed_tokens
        for out in engine.step():
            finished_at[out.request_id] = step
            if out.request_id == "multi":
                assert out.data.shape == (6, 64) and out.data.dtype == torch.float32
                assert out.prompt_token_ids == inputs and out.num_prompt_tokens == sum(map(len, inputs))
                multi = out.data
        assert engine.num_computed_tokens - before <= 256  # whole sequences, never over budget
        step += 1
    # 200+8 | 120 | 150+3+9 (3 sequences at most) | 30: the multi-input request ends in step 2.
    assert finished_at == {"multi": 2, "single": 3}
    for row, tokens in zip(multi, inputs, strict=True):  # packed or alone: the same vector
        torch.testing.assert_close(row, embed_alone(engine, tokens), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(multi.norm(dim=-1), torch.ones(6))


def test_max_num_seqs_bounds_a_step(bert: Path) -> None:
    engine = EmbeddingEngine.from_model(bert, max_num_batched_tokens=512, max_num_seqs=2)
    engine.add_request("r", inputs=[ids(5, s) for s in range(5)])
    steps = len([engine.step() for _ in range(3)])
    assert steps == 3 and not engine.has_unfinished()


def test_abort(bert: Path) -> None:
    engine = EmbeddingEngine.from_model(bert, max_num_batched_tokens=64)
    engine.add_request("a", inputs=[ids(40), ids(40, 1)])
    engine.add_request("b", inputs=[ids(10)])
    engine.abort("a")
    engine.abort("unknown")
    outs = run(engine)
    assert outs["a"].data is None and outs["a"].error is None
    assert outs["b"].data.shape == (1, 64)
    assert engine.num_unfinished() == 0
    engine.add_request("a", inputs=[ids(4)])  # the id is free again
    assert run(engine)["a"].data.shape == (1, 64)


def test_bad_requests_name_the_field(bert: Path) -> None:
    engine = EmbeddingEngine.from_model(bert, max_num_batched_tokens=128)
    cases = {
        "^inputs must be a non-empty list": dict(inputs=[]),
        r"^inputs\[1\]: the input is empty": dict(inputs=[[5], []]),
        r"^inputs\[0\]: the input is an empty string": dict(inputs=[""]),
        r"^inputs\[0\]\[1\] must be a token id in \[0, \d+\), got 100000": dict(inputs=[[5, 100000]]),
        r"^inputs\[0\]\[0\] must be a token id .* got True": dict(inputs=[[True]]),
        r"^inputs\[1\]: the input has 129 tokens, more than max_model_len 128": dict(inputs=[[5], ids(129)]),
        "^truncate_prompt_tokens 200 exceeds max_model_len": dict(inputs=[[5]], pooling_params={
            "truncate_prompt_tokens": 200}),
        "^dimensions 65 is larger": dict(inputs=[[5]], pooling_params=PoolingParams(dimensions=65)),
        "^dimensions: this model does not support": dict(inputs=[[5]], pooling_params={"dimensions": 8}),
        "^frobnicate is not a pooling parameter": dict(inputs=[[5]], pooling_params={"frobnicate": 1}),
        "^sampling_params: this is an embedding model": dict(inputs=[[5]], sampling_params={"max_tokens": 1}),
        "^inputs: give exactly one of": dict(inputs=[[5]], prompt="hi"),
    }
    for message, kwargs in cases.items():
        with pytest.raises(ValueError, match=message):
            engine.add_request("r", **kwargs)
    assert not engine.has_unfinished()  # nothing half-queued
    engine.add_request("r", inputs=[[5]])
    with pytest.raises(ValueError, match="already in the engine"):
        engine.add_request("r", inputs=[[5]])


def test_truncate_prompt_tokens_keeps_the_last_tokens(bert: Path) -> None:
    engine = EmbeddingEngine.from_model(bert, max_num_batched_tokens=128)
    long = ids(300)
    engine.add_request("t", inputs=[long], pooling_params={"truncate_prompt_tokens": 100})
    out = run(engine)["t"]
    assert out.prompt_token_ids == [long[-100:]]
    torch.testing.assert_close(out.data[0], embed_alone(engine, long[-100:]))


def test_pooling_overrides_dimensions_and_normalize(bert: Path, matryoshka: Path) -> None:
    engine = EmbeddingEngine.from_model(matryoshka, max_num_batched_tokens=128)
    assert engine.matryoshka
    tokens = ids(50)
    raw = embed_alone(engine, tokens, normalize=False)
    assert abs(float(raw.norm()) - 1.0) > 0.01
    unit = embed_alone(engine, tokens)
    torch.testing.assert_close(unit, raw / raw.norm())
    short = embed_alone(engine, tokens, dimensions=32)  # truncated, then normalised
    assert short.shape == (32,)
    torch.testing.assert_close(short, raw[:32] / raw[:32].norm())
    with pytest.raises(ValueError, match="^dimensions 24 is not one of"):
        engine.add_request("x", inputs=[tokens], pooling_params={"dimensions": 24})
    cls = embed_alone(engine, tokens, pooling_type="cls", normalize=False)
    last = embed_alone(engine, tokens, pooling_type="last", normalize=False)
    model = engine.model
    with torch.inference_mode():
        hidden = model(torch.tensor(tokens), torch.arange(50), torch.tensor([0, 50], dtype=torch.int32))
    torch.testing.assert_close(cls, hidden[0].float())
    torch.testing.assert_close(last, hidden[-1].float())
    torch.testing.assert_close(raw, hidden.float().mean(0), rtol=1e-5, atol=1e-5)


def test_engine_build_errors(bert: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_model_len 200 exceeds max_num_batched_tokens 128"):
        EmbeddingEngine.from_model(bert, max_num_batched_tokens=128, max_model_len=200)
    with pytest.raises(ValueError, match="max_model_len 1000 exceeds the model's maximum input length 256"):
        EmbeddingEngine.from_model(bert, max_num_batched_tokens=2048, max_model_len=1000)
    llama = make_tiny_model(tmp_path / "llama")
    assert not is_embedding_model(llama)
    with pytest.raises(ValueError, match="is not an embedding model"):
        EmbeddingEngine.from_model(llama)
    other = make_tiny_embedding_model(tmp_path / "deberta", architectures=["DebertaV2Model"])
    assert is_embedding_model(other)  # sentence-transformers files: the embedding engine says why not
    with pytest.raises(ValueError, match="embedding architecture DebertaV2Model; supported: BertModel"):
        EmbeddingEngine.from_model(other)


def test_llm_embed_is_vllm_shaped(bert: Path) -> None:
    llm = LLM(model=str(bert), max_num_batched_tokens=256)
    assert llm.task == "embed"
    tok = llm.get_tokenizer()
    text = "the quick brown fox jumps over the lazy dog"
    one = llm.embed(text)
    assert len(one) == 1 and isinstance(one[0], EmbeddingRequestOutput)
    assert one[0].outputs.hidden_size == 64 and one[0].prompt_token_ids == tok.encode(text)
    forms = llm.embed([text, tok.encode(text), {"prompt": text}, {"prompt_token_ids": tok.encode(text)}])
    for out in forms:
        assert out.outputs.embedding == pytest.approx(one[0].outputs.embedding, abs=1e-6)
    assert len(llm.embed(tok.encode(text))) == 1  # a bare list of ints is one prompt
    per_prompt = llm.embed([text, text], pooling_params=[PoolingParams(), PoolingParams(normalize=False)])
    assert per_prompt[0].outputs.embedding != per_prompt[1].outputs.embedding
    # a text keeps [CLS] ... [SEP] around its last tokens (as the queue's intake does); ids are cut plainly
    full, content = tok.encode(text), tok.encode(text, add_special_tokens=False)
    assert len(full) == len(content) + 2
    truncated = llm.embed([text, full], truncate_prompt_tokens=3)
    assert truncated[0].prompt_token_ids == [full[0], content[-1], full[-1]]
    assert truncated[1].prompt_token_ids == full[-3:]
    with pytest.raises(ValueError, match=r"^prompts\[1\]: the prompt is an empty string"):
        llm.embed([text, ""])
    with pytest.raises(ValueError, match=r"^prompts\[1\]: inputs\[0\]: the input has 300 tokens"):
        llm.embed([text, [5] * 300])
    assert not llm.engine.has_unfinished()  # a refused call leaves nothing queued
    with pytest.raises(ValueError, match="pooling_params: 1 given for 2 prompts"):
        llm.embed([text, text], pooling_params=[PoolingParams()])
    with pytest.raises(ValueError, match=r"LLM.generate\(\) is only supported for generative models"):
        llm.generate("hi")
    with pytest.raises(ValueError, match=r"LLM.chat\(\) is only supported for generative models"):
        llm.chat([{"role": "user", "content": "hi"}])


def test_llm_embed_on_a_generation_model_is_an_error(tmp_path: Path) -> None:
    llm = LLM(model=str(make_tiny_model(tmp_path / "llama")), num_kv_blocks=16)
    assert llm.task == "generate"
    with pytest.raises(ValueError, match=r"LLM.embed\(\) is only supported for embedding models"):
        llm.embed("hi")


def test_decoder_embedder_runs_causal_without_a_cache(tmp_path: Path) -> None:
    """Last-token pooling of a causal model: a prefix's vector does not depend on what follows it."""
    engine = EmbeddingEngine.from_model(make_tiny_embedding_model(tmp_path / "q", "qwen3"),
                                        max_num_batched_tokens=128)
    tokens = ids(40)
    engine.add_request("r", inputs=[tokens, tokens[:20]], pooling_params={"normalize": False})
    full, prefix = run(engine)["r"].data
    assert not torch.allclose(full, prefix)
    engine.add_request("m", inputs=[tokens[:20]], pooling_params={"pooling_type": "mean", "normalize": False})
    mean = run(engine)["m"].data[0]
    assert not torch.allclose(mean, prefix)


@pytest.mark.gpu
def test_cuda_matches_cpu(bert: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    texts = ["the quick brown fox", "hello world " * 30, "a"]
    cpu = torch.tensor([o.outputs.embedding for o in LLM(model=str(bert)).embed(texts)])
    gpu = torch.tensor([o.outputs.embedding for o in LLM(model=str(bert), device="cuda").embed(texts)])
    assert torch.nn.functional.cosine_similarity(cpu, gpu).min() >= 0.9999


def test_tensor_parallelism_is_refused_for_embedding_models(bert: Path) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size 2: embedding models run on one device"):
        EmbeddingEngine.from_model(bert, tensor_parallel_size=2)
