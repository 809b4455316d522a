"""``Engine``: request validation, the step loop's outputs, stops, abort, error isolation, sizing."""

from __future__ import annotations

import pytest
import torch

from batchinfer.workers.engine.engine import Engine
from batchinfer.workers.engine_config import EngineConfig
from batchinfer.workers.sampling_params import SamplingParams


def run(engine: Engine) -> dict[str, list]:
    """Step until idle; every output of every step, by request id."""
    seen: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    return seen


GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def greedy_tokens(engine: Engine, prompt_ids: list[int], n: int = 10) -> list[int]:
    engine.add_request("ref", prompt_token_ids=prompt_ids,
                       sampling_params=SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    return run(engine)["ref"][-1].outputs[0].token_ids


def test_step_streams_every_request_until_it_finishes(engine_factory):
    engine = engine_factory()
    engine.add_request("a", prompt="Hello world", sampling_params=GREEDY)
    engine.add_request("b", prompt_token_ids=[5, 6, 7],
                       sampling_params=SamplingParams(temperature=0.0, max_tokens=3))
    assert engine.num_unfinished() == 2 and engine.has_unfinished()
    seen = run(engine)
    assert [len(o.outputs[0].token_ids) for o in seen["a"]] == list(range(1, 11))
    assert [o.finished for o in seen["a"]] == [False] * 9 + [True]
    assert seen["b"][-1].finished and len(seen["b"]) == 3
    final = seen["a"][-1]
    assert final.prompt == "Hello world" and final.outputs[0].finish_reason == "length"
    assert final.prompt_token_ids == engine.tokenizer.encode("Hello world")
    assert final.outputs[0].text == engine.tokenizer.decode(final.outputs[0].token_ids)
    assert engine.num_unfinished() == 0 and engine.kv_usage == 0.0
    assert engine.num_generated_tokens == 13 and engine.num_running == engine.num_waiting == 0


def test_stop_token_ids_and_eos_finish_with_stop(engine_factory):
    engine = engine_factory()
    prompt = list(range(40, 60))
    ref = greedy_tokens(engine, prompt, 12)
    stop_id = next(t for t in ref[3:] if t not in engine.eos_token_ids)
    engine.add_request("s", prompt_token_ids=prompt, sampling_params=SamplingParams(
        temperature=0.0, max_tokens=12, stop_token_ids=[stop_id], ignore_eos=True))
    out = run(engine)["s"][-1].outputs[0]
    first = ref.index(stop_id)
    assert out.token_ids == ref[:first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_id
    # The same token as EOS: a stop with no stop_reason, unless ignore_eos.
    eos_engine = engine_factory()
    eos_engine.eos_token_ids = [stop_id]  # the real EOS ids no longer stop
    eos_engine.add_request("e", prompt_token_ids=prompt,
                           sampling_params=SamplingParams(temperature=0.0, max_tokens=12))
    eos_engine.add_request("i", prompt_token_ids=prompt, sampling_params=GREEDY)
    seen = run(eos_engine)
    assert seen["e"][-1].outputs[0].finish_reason == "stop" and seen["e"][-1].outputs[0].stop_reason is None
    assert seen["e"][-1].outputs[0].token_ids == ref[:first + 1]
    assert seen["i"][-1].outputs[0].token_ids == ref[:10]


def test_stop_string_cuts_the_text(engine_factory):
    engine = engine_factory()
    prompt = list(range(60, 90))
    ref = greedy_tokens(engine, prompt, 12)
    text = engine.tokenizer.decode(ref)
    stop = text[3:6]
    assert stop and stop in text
    engine.add_request("t", prompt_token_ids=prompt, sampling_params=SamplingParams(
        temperature=0.0, max_tokens=12, stop=[stop]))
    out = run(engine)["t"][-1].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:text.index(stop)]


def test_max_tokens_none_runs_to_max_model_len(engine_factory):
    engine = engine_factory(max_model_len=40)
    engine.add_request("m", prompt_token_ids=list(range(30)),
                       sampling_params=SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))
    out = run(engine)["m"][-1].outputs[0]
    assert len(out.token_ids) == 10 and out.finish_reason == "length"


def test_logprobs_hold_the_sampled_token_and_the_top_k(engine_factory):
    engine = engine_factory()
    engine.add_request("l", prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(
        temperature=0.0, max_tokens=4, logprobs=3, ignore_eos=True))
    out = run(engine)["l"][-1].outputs[0]
    assert len(out.logprobs) == 4
    tok = engine.tokenizer
    for token, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert token in lp and len(lp) == 3 and lp[token].rank == 1  # greedy: the top one
        assert lp[token].logprob == max(v.logprob for v in lp.values())
        assert sorted(v.rank for v in lp.values()) == [1, 2, 3]
        for t, v in lp.items():  # each token decoded alone, special tokens kept (vLLM's decoded_token)
            assert v.decoded_token == tok.decode([t], skip_special_tokens=False)
            assert v.token_bytes is not None
    sampled = [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs, strict=True)]
    assert out.cumulative_logprob == pytest.approx(sum(sampled))


def test_no_logprobs_asked_means_none(engine_factory):
    engine = engine_factory()
    engine.add_request("p", prompt_token_ids=[1, 2, 3], sampling_params=GREEDY)
    out = run(engine)["p"][-1].outputs[0]
    assert out.logprobs is None and out.cumulative_logprob is None


def test_abort_finishes_one_request_and_frees_its_blocks(engine_factory):
    engine = engine_factory()
    engine.add_request("keep", prompt_token_ids=list(range(20)), sampling_params=GREEDY)
    engine.add_request("drop", prompt_token_ids=list(range(50, 90)), sampling_params=GREEDY)
    engine.step()
    engine.step()
    engine.abort("drop")
    engine.abort("unknown")  # ignored
    outs = {o.request_id: o for o in engine.step()}
    assert outs["drop"].finished and outs["drop"].outputs[0].finish_reason == "abort"
    assert len(outs["drop"].outputs[0].token_ids) == 2
    seen = run(engine)
    assert "drop" not in seen and seen["keep"][-1].outputs[0].finish_reason == "length"
    assert engine.block_manager.num_free_blocks == engine.runner.num_blocks


def test_a_request_failing_in_postprocess_is_aborted_and_the_loop_goes_on(engine_factory):
    class BrokenDetokenizer:
        text = ""

        def append(self, token_id: int) -> str:
            raise RuntimeError("decoder exploded")

    engine = engine_factory()
    engine.add_request("ok", prompt_token_ids=[1, 2, 3], sampling_params=GREEDY)
    engine.add_request("bad", prompt_token_ids=[4, 5, 6], sampling_params=SamplingParams(n=2, max_tokens=5))
    engine.requests["bad"].seqs[1].detokenizer = BrokenDetokenizer()  # a fault in one completion
    seen = run(engine)
    bad = seen["bad"][-1]
    assert bad.finished and [c.finish_reason for c in bad.outputs] == ["abort", "abort"]
    assert "decoder exploded" in bad.error
    assert seen["ok"][-1].outputs[0].finish_reason == "length" and seen["ok"][-1].error is None
    assert engine.block_manager.num_free_blocks == engine.runner.num_blocks


def test_seeded_request_gives_the_same_tokens_in_any_batch(engine_factory):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=8, ignore_eos=True)
    alone = engine_factory()
    alone.add_request("x", prompt_token_ids=[9, 8, 7], sampling_params=params)
    ref = run(alone)["x"][-1].outputs[0].token_ids
    crowded = engine_factory(max_num_batched_tokens=16)
    for i in range(5):
        crowded.add_request(f"o{i}", prompt_token_ids=list(range(i, i + 20)),
                            sampling_params=SamplingParams(temperature=1.0, max_tokens=6))
    crowded.add_request("x", prompt_token_ids=[9, 8, 7], sampling_params=params)
    assert run(crowded)["x"][-1].outputs[0].token_ids == ref


def test_seeded_generators_stay_on_the_cpu_whatever_the_model_device(engine_factory, monkeypatch):
    """The sampler draws one number per step from a seeded completion's generator: a CPU one,
    whose draws are the same whichever device the model runs on (and cost no device sync)."""
    from batchinfer.workers.engine.sampler import make_generator

    engine = engine_factory()
    # A device no generator can be made on: only the model may live there, never the generators.
    monkeypatch.setattr(engine.runner, "device", torch.device("meta"))
    req = engine.make_request("s", prompt_token_ids=[1, 2], sampling_params=SamplingParams(seed=3, n=2))
    assert [seq.generator.device.type for seq in req.seqs] == ["cpu", "cpu"]
    draws = [torch.rand(4, generator=seq.generator).tolist() for seq in req.seqs]
    assert draws == [torch.rand(4, generator=make_generator(3, i)).tolist() for i in range(2)]


def test_num_cached_tokens_reports_prefix_hits(engine_factory):
    engine = engine_factory()
    prompt = list(range(100, 140))  # 2 full blocks of 16 and a tail
    engine.add_request("first", prompt_token_ids=prompt, sampling_params=GREEDY)
    assert run(engine)["first"][-1].num_cached_tokens == 0
    engine.add_request("second", prompt_token_ids=prompt, sampling_params=GREEDY)
    assert run(engine)["second"][-1].num_cached_tokens == 32
    assert engine.prefix_hit_rate == 32 / 80


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"prompt_token_ids": list(range(300))}, "prompt_token_ids"),
    ({"prompt_token_ids": [1, 2], "sampling_params": SamplingParams(max_tokens=255)}, "max_tokens"),
    ({"prompt_token_ids": []}, "prompt_token_ids"),
    ({"prompt_token_ids": [1, -1]}, r"prompt_token_ids\[1\]"),
    ({"prompt_token_ids": [1, 2.0]}, r"prompt_token_ids\[1\]"),
    ({}, "prompt"),
    ({"prompt": "x", "prompt_token_ids": [1]}, "prompt"),
    ({"prompt_token_ids": [1], "sampling_params": {"top_p": 0}}, "top_p"),
    ({"prompt_token_ids": [1], "sampling_params": {"max_tokens": 0}}, "max_tokens"),
    ({"prompt_token_ids": [1], "sampling_params": {"temperature": 1, "colour": "red"}}, "colour"),
])
def test_bad_requests_raise_naming_the_field_and_change_nothing(engine_factory, kwargs, field):
    engine = engine_factory(max_model_len=256)
    with pytest.raises(ValueError, match=field):
        engine.add_request("r", **kwargs)
    assert not engine.has_unfinished()


def test_duplicate_request_id_is_refused(engine_factory):
    engine = engine_factory()
    engine.add_request("same", prompt_token_ids=[1])
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("same", prompt_token_ids=[2])


def test_capacity_and_kv_sizing(engine_factory, tiny_llama):
    engine = engine_factory(num_kv_blocks=10, max_num_seqs=4, max_num_batched_tokens=32)
    assert engine.capacity() == {"max_model_len": 160, "max_num_seqs": 4, "max_num_batched_tokens": 32,
                                 "kv_tokens": 160}
    per_block = engine.runner.bytes_per_block
    by_bytes = engine_factory(num_kv_blocks=None, kv_cache_memory=per_block * 7 + 5)
    assert by_bytes.runner.num_blocks == 7
    k_cache, v_cache = by_bytes.runner.kv_caches[0]
    assert k_cache.shape == (7, 16, 2, 16) and v_cache.dtype == torch.float32
    with pytest.raises(ValueError, match="max_model_len"):
        engine_factory(num_kv_blocks=4, max_model_len=100)
    with pytest.raises(ValueError, match="max_model_len"):
        engine_factory(max_model_len=10_000)
    with pytest.raises(ValueError, match="kv_cache_memory"):
        engine_factory(num_kv_blocks=None, kv_cache_memory=1)


@pytest.mark.parametrize(("field", "value"), [
    ("block_size", 0), ("num_kv_blocks", -1), ("max_num_seqs", 1.5), ("dtype", "int8"),
    ("gpu_memory_utilization", 1.5), ("enable_prefix_caching", "yes"), ("device", "nonsense"),
])
def test_engine_config_names_the_bad_field(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(model="somewhere", **{field: value})


@pytest.mark.gpu
def test_cuda_engine_with_graphs_matches_eager(tiny_llama):
    prompts = [list(range(i, i + 5 + 7 * i)) for i in range(6)]
    results = []
    for eager in (True, False):
        config = EngineConfig(model=str(tiny_llama), device="cuda", num_kv_blocks=64, enforce_eager=eager)
        engine = Engine(config)
        assert (engine.runner.graphs is None) == eager
        for i, p in enumerate(prompts):
            engine.add_request(str(i), prompt_token_ids=p, sampling_params=GREEDY)
        seen = run(engine)
        results.append([seen[str(i)][-1].outputs[0].token_ids for i in range(len(prompts))])
    assert results[0] == results[1]


def test_from_model_and_the_lazy_public_api(tiny_llama):
    import batchinfer
    from batchinfer.client.client import Client
    from batchinfer.workers.entrypoints.llm import LLM

    engine = Engine.from_model(tiny_llama, num_kv_blocks=8, max_num_seqs=2)
    assert engine.model_name == tiny_llama.name and engine.capacity()["kv_tokens"] == 128
    assert batchinfer.LLM is LLM and batchinfer.Client is Client
    assert batchinfer.SamplingParams is SamplingParams
    with pytest.raises(AttributeError, match="nothing"):
        batchinfer.nothing  # noqa: B018


def test_cuda_graph_batch_sizes():
    from batchinfer.workers.engine.cuda_graph import batch_sizes

    assert batch_sizes(1) == [1]
    assert batch_sizes(8) == [1, 2, 4, 8]
    assert batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert batch_sizes(256)[-3:] == [224, 240, 256]


def test_building_an_engine_leaves_the_global_rng_alone(tiny_llama):
    with torch.random.fork_rng():
        torch.manual_seed(99)
        state = torch.random.get_rng_state()
        Engine(EngineConfig(model=str(tiny_llama), num_kv_blocks=8, seed=0))
        assert torch.equal(torch.random.get_rng_state(), state)


def test_unseeded_requests_follow_the_engine_seed_not_the_global_rng(engine_factory):
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)

    def sample(seed: int, global_seed: int) -> list[int]:
        engine = engine_factory(seed=seed)
        with torch.random.fork_rng():
            torch.manual_seed(global_seed)  # whatever the process did with torch's RNG meanwhile
            engine.add_request("u", prompt_token_ids=[5, 6, 7], sampling_params=params)
            return run(engine)["u"][-1].outputs[0].token_ids

    first = sample(5, global_seed=1)
    assert sample(5, global_seed=2) == first
    assert sample(6, global_seed=1) != first


def test_host_staging_copies_each_step_into_slices_of_its_buffers():
    import numpy as np

    from batchinfer.workers.engine.model_runner import HostStaging

    staging = HostStaging(torch.device("cpu"), max_tokens=8, max_seqs=2, max_blocks_per_seq=3)
    buffers = {name: buf.data_ptr() for name, buf in staging.buffers.items()}
    with torch.inference_mode():  # as ModelRunner.execute calls it
        out = staging.transfer({"input_ids": np.arange(6, dtype=np.int64),
                                "block_tables": np.array([[1, 2, 3], [4, 5, 6]], np.int32)})
        assert out["input_ids"].tolist() == list(range(6))
        tables = out["block_tables"]
        assert tables.dtype == torch.int32 and tables.tolist() == [[1, 2, 3], [4, 5, 6]]
        assert out["input_ids"].data_ptr() == buffers["input_ids"]  # a slice of the buffer, no new memory
        out = staging.transfer({"block_tables": np.array([[7], [8]], np.int32)})  # a narrower step
        assert out["block_tables"].tolist() == [[7], [8]]
        big = staging.transfer({"positions": np.arange(9, dtype=np.int64)})["positions"]  # past the buffer
        assert big.tolist() == list(range(9)) and big.data_ptr() != buffers["positions"]
        with pytest.raises(TypeError):  # a dtype other than the buffer's is a bug, not a silent cast
            staging.transfer({"seq_lens": np.array([3, 4], np.int64)})
    assert {name: buf.data_ptr() for name, buf in staging.buffers.items()} == buffers


def test_the_cpu_runner_stages_nothing(engine_factory):
    assert engine_factory().runner.staging is None
