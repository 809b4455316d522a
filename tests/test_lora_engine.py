"""LoRA adapters per request in the engine: greedy tokens identical to transformers + PEFT, for one
adapter and for several adapters mixed with the base model in one step (through chunked prefill,
preemption and prefix caching); prefix-cache blocks kept apart per adapter; more adapters than
slots (slot and host LRU churn, background reloads); unknown adapters; failed reloads."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from lora_cases import PHI3_TARGETS, PROMPTS, make_base, make_peft_adapter, peft_greedy

from batchinfer.workers.engine.engine import Engine
from batchinfer.workers.engine.sequence import SequenceStatus
from batchinfer.workers.engine_config import EngineConfig
from batchinfer.workers.lora.adapter import LoRAAdapter, lora_groups
from batchinfer.workers.lora.stack import LoRAStack
from batchinfer.workers.lora_request import LoRARequest
from batchinfer.workers.sampling_params import SamplingParams

pytest.importorskip("peft")

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# Five adapters of the tiny Llama: ranks, targets, scalings (rsLoRA) and seeds all differ.
ADAPTERS: dict[str, dict] = {
    "a0": dict(r=8, alpha=16, seed=1),
    "a1": dict(r=4, alpha=8, seed=2, targets=("q_proj", "v_proj")),
    "rs": dict(r=8, alpha=4, seed=3, rslora=True),
    "a3": dict(r=2, alpha=4, seed=4, targets=("o_proj", "down_proj", "up_proj")),
    "a4": dict(r=6, alpha=6, seed=5, targets=("k_proj", "gate_proj")),
}


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> dict:
    """The tiny Llama, its adapters, the loaded model and PEFT's greedy tokens for each (None: base)."""
    root = tmp_path_factory.mktemp("lora-llama")
    base = make_base(root / "base")
    paths = {name: str(make_peft_adapter(base, root / name, **kw)) for name, kw in ADAPTERS.items()}
    refs = {name: peft_greedy(base, None if name is None else paths[name], PROMPTS, MAX_TOKENS)
            for name in [None, *paths]}
    loaded = Engine(EngineConfig(model=str(base), num_kv_blocks=4))
    return {"base": base, "paths": paths, "refs": refs, "model": loaded.model, "tokenizer": loaded.tokenizer}


def make_engine(case: dict, adapters: list[str] | None = None, **config) -> Engine:
    modules = {n: case["paths"][n] for n in (case["paths"] if adapters is None else adapters)}
    config.setdefault("num_kv_blocks", 64)
    engine_config = EngineConfig(model=str(case["base"]), lora_modules=modules, **config)
    return Engine(engine_config, model=case["model"], tokenizer=case["tokenizer"])


def run_all(engine: Engine, check=None) -> dict[str, list[int]]:
    """Step until idle (``check(engine)`` after every step); final tokens by request id."""
    done: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                assert out.error is None, out.error
                done[out.request_id] = out.outputs[0].token_ids
        if check is not None:
            check(engine)
    return done


def submit(engine: Engine, names: list[str | None]) -> dict[str, tuple[str | None, int]]:
    """Every prompt under every adapter of ``names``, interleaved: request id -> (adapter, prompt)."""
    jobs = {}
    for p in range(len(PROMPTS)):
        for name in names:
            rid = f"{name}/{p}"
            engine.add_request(rid, prompt_token_ids=PROMPTS[p], sampling_params=GREEDY, lora=name)
            jobs[rid] = (name, p)
    return jobs


def check_slots(engine: Engine) -> None:
    """A running sequence's adapter is in its slot, and each slot counts exactly its runners."""
    manager = engine.lora
    assert manager is not None
    runners = [0] * manager.max_loras
    for seq in engine.scheduler.running:
        if seq.lora is None:
            assert seq.lora_slot == -1
            continue
        assert manager.slot_names[seq.lora_slot] == seq.lora
        runners[seq.lora_slot] += 1
    assert manager.refs == runners
    assert all(s.lora_slot == -1 for s in engine.scheduler.waiting)


@pytest.mark.parametrize("name", ["a0", "rs"])
def test_one_adapter_alone_matches_peft(llama, name):
    engine = make_engine(llama, [name])
    assert engine.lora_adapters() == [name] and engine.resident_adapters() == []
    jobs = submit(engine, [name])
    done = run_all(engine)
    assert [done[rid] for rid in jobs] == llama["refs"][name]
    assert llama["refs"][name] != llama["refs"][None]  # the adapter changes the tokens
    assert engine.resident_adapters() == [name]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_four_adapters_and_the_base_mixed_through_chunked_prefill_and_preemption(llama, prefix_caching):
    # 16 tokens a step: prompts are prefilled in chunks next to decodes. 5 blocks of 4 tokens:
    # 20 sequences of up to 17 tokens cannot all hold their blocks, so some are preempted.
    engine = make_engine(llama, ["a0", "a1", "rs", "a3"], max_loras=4, max_num_batched_tokens=16,
                         block_size=4, num_kv_blocks=12, enable_prefix_caching=prefix_caching)
    mixed_steps = []

    def check(e: Engine) -> None:
        check_slots(e)
        mixed_steps.append(len({s.lora for s in e.scheduler.running}))

    jobs = submit(engine, [None, "a0", "a1", "rs", "a3"])
    done = run_all(engine, check)
    for rid, (name, p) in jobs.items():
        assert done[rid] == llama["refs"][name][p], rid
    assert engine.num_preemptions > 0
    assert max(mixed_steps) >= 3  # adapters and the base ran in the same steps
    assert sorted(engine.resident_adapters()) == ["a0", "a1", "a3", "rs"]


def test_phi3_fused_targets_match_peft(tmp_path):
    base = make_base(tmp_path / "phi3", "Phi3ForCausalLM")
    adapter = make_peft_adapter(base, tmp_path / "fused", r=4, alpha=8, targets=PHI3_TARGETS, seed=7)
    refs = peft_greedy(base, adapter, PROMPTS, MAX_TOKENS)
    engine = Engine(EngineConfig(model=str(base), num_kv_blocks=32, lora_modules={"fused": str(adapter)}))
    jobs = submit(engine, ["fused", None])
    done = run_all(engine)
    assert [done[f"fused/{p}"] for p in range(len(PROMPTS))] == refs
    assert [done[f"None/{p}"] for p in range(len(PROMPTS))] != refs
    assert len(jobs) == 2 * len(PROMPTS)


def test_moe_model_attention_adapter_matches_peft(tmp_path):
    from moe_models import make_tiny_moe_model

    base = make_tiny_moe_model(tmp_path / "moe", "Qwen3MoeForCausalLM")  # layer 0 MoE, layer 1 dense
    adapter = make_peft_adapter(base, tmp_path / "attn", r=4, alpha=8, seed=8,
                                targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    refs = peft_greedy(base, adapter, PROMPTS, MAX_TOKENS)
    engine = Engine(EngineConfig(model=str(base), num_kv_blocks=32, lora_modules={"attn": str(adapter)}))
    assert engine.model.config.moe_layers == (0,)  # its experts take no LoRA, its attention does
    jobs = submit(engine, ["attn", None])
    done = run_all(engine)
    assert [done[rid] for rid, (name, _) in jobs.items() if name == "attn"] == refs
    assert [done[rid] for rid, (name, _) in jobs.items() if name is None] != refs


def test_prefix_cache_is_shared_within_an_adapter_never_across(llama):
    engine = make_engine(llama, ["a0", "a1"], block_size=4)
    prompt = list(range(10, 30))  # 20 tokens: 4 full blocks of 4 are cacheable (the last token runs)

    def cached(rid: str, lora: str | None) -> int:
        engine.add_request(rid, prompt_token_ids=prompt, sampling_params=GREEDY, lora=lora)
        run_all(engine)
        return engine.block_manager.num_hit_tokens

    hits = [cached("a0-first", "a0"), cached("a1", "a1"), cached("base", None), cached("a0-again", "a0"),
            cached("base-again", None)]
    assert hits == [0, 0, 0, 16, 32]  # only a0 after a0 and base after base hit 16 tokens


def test_more_adapters_than_slots_and_host_cache(llama):
    # 5 adapters, 2 slots, 3 on the host: slots are reused, evicted adapters reload from disk.
    engine = make_engine(llama, max_loras=2, max_cpu_loras=3, max_num_batched_tokens=24)
    manager = engine.lora
    assert manager is not None and manager.num_loads == 5 and len(manager.host) == 3
    jobs = submit(engine, [*ADAPTERS, None])
    done = run_all(engine, check_slots)
    for rid, (name, p) in jobs.items():
        assert done[rid] == llama["refs"][name][p], rid
    assert manager.num_loads > 5  # some adapters were read again in the background
    assert manager.num_slot_loads > 2 and len(engine.resident_adapters()) == 2
    assert len(manager.host) <= 3


def test_unknown_adapter_names_what_is_served(llama, engine_factory):
    engine = make_engine(llama, ["a1", "a0"])
    with pytest.raises(ValueError, match=r"^lora: adapter 'nope' is not served by this engine; "
                                         r"it serves: a0, a1$"):
        engine.add_request("x", prompt_token_ids=[1, 2], lora="nope")
    plain = engine_factory()
    with pytest.raises(ValueError, match="adapter 'a0' is not served by this engine; it serves no adapters"):
        plain.add_request("x", prompt_token_ids=[1, 2], lora="a0")
    assert plain.lora_adapters() == [] and plain.resident_adapters() == []
    assert engine.num_unfinished() == 0 and plain.num_unfinished() == 0


def test_lora_request_registers_on_first_use(llama):
    engine = make_engine(llama, [], enable_lora=True, max_lora_rank=8)
    assert engine.lora_adapters() == []
    request = LoRARequest("rs", 1, llama["paths"]["rs"])
    engine.add_request("r", prompt_token_ids=PROMPTS[0], sampling_params=GREEDY, lora=request)
    assert engine.lora_adapters() == ["rs"]
    engine.add_request("n", prompt_token_ids=PROMPTS[1], sampling_params=GREEDY, lora="rs")
    with pytest.raises(ValueError, match="adapter 'rs' is served from .*; it cannot also come from"):
        engine.add_request("bad", prompt_token_ids=PROMPTS[0],
                           lora=LoRARequest("rs", 1, llama["paths"]["a0"]))
    done = run_all(engine)
    assert [done["r"], done["n"]] == llama["refs"]["rs"][:2]


def test_a_bad_served_adapter_refuses_the_engine(llama, tmp_path):
    broken = Path(shutil.copytree(llama["paths"]["a0"], tmp_path / "broken"))
    (broken / "adapter_model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"lora adapter 'broken' .*no adapter_model.safetensors"):
        make_engine({**llama, "paths": {"broken": str(broken)}})
    with pytest.raises(ValueError, match="rank 8 is above the limit of 4"):
        make_engine(llama, ["a0"], max_lora_rank=4)


def test_a_failed_background_reload_aborts_its_requests_only(llama, tmp_path):
    paths = {n: str(shutil.copytree(llama["paths"][n], tmp_path / n)) for n in ("a0", "a1")}
    engine = make_engine({**llama, "paths": paths}, max_loras=1, max_cpu_loras=1)
    manager = engine.lora
    assert manager is not None and list(manager.host) == ["a1"]  # a0 was evicted from the host
    (Path(paths["a0"]) / "adapter_model.safetensors").unlink()  # its reload will fail
    submit(engine, ["a0", "a1", None])
    seen: dict = {}
    while engine.has_unfinished():
        for out in engine.step():
            seen[out.request_id] = out
    for p in range(len(PROMPTS)):
        failed = seen[f"a0/{p}"]
        assert failed.finished and failed.outputs[0].finish_reason == "abort"
        assert failed.error is not None and "no adapter_model.safetensors" in failed.error
        assert seen[f"a1/{p}"].outputs[0].token_ids == llama["refs"]["a1"][p]
        assert seen[f"None/{p}"].outputs[0].token_ids == llama["refs"][None][p]
    assert engine.kv_usage == 0.0 and manager.refs == [0]


def test_stack_pads_ranks_and_clears_slots(llama):
    config = llama["model"].config
    stack = LoRAStack(config, max_loras=2, max_rank=4, dtype=torch.float32, device="cpu")
    group = lora_groups(config, 0)[0]  # qkv_proj: 3 slices
    a = torch.randn(3 * 2, group.in_features)  # rank 2
    bs = tuple(torch.randn(out, 2) for out in group.out_features)
    stack.load(1, LoRAAdapter("x", "-", rank=2, scaling=1.0, weights={(0, "qkv_proj"): (a, bs)}))
    big_a, big_bs = stack.weights[(0, "qkv_proj")]
    assert torch.equal(big_a[1, 4:6], a[2:4]) and big_a[1, 2:4].abs().sum() == 0
    assert torch.equal(big_bs[2][1, :, :2], bs[2]) and big_bs[2][1, :, 2:].abs().sum() == 0
    assert big_a[0].abs().sum() == 0 and stack.slot_ranks == [0, 2]
    x = torch.randn(3, group.in_features)
    y = torch.zeros(3, sum(group.out_features))
    step = stack.step(torch.tensor([1, -1, 1]).numpy())
    assert step is not None
    step.apply(0, "qkv_proj", y, x)
    want = torch.cat([x @ a[2 * i:2 * i + 2].T @ bs[i].T for i in range(3)], dim=1)
    torch.testing.assert_close(y[[0, 2]], want[[0, 2]])
    assert y[1].abs().sum() == 0
    stack.clear(1)
    assert big_a.abs().sum() == 0 and stack.slot_ranks == [0, 0]
    assert stack.step(torch.tensor([-1, -1]).numpy()) is None


def test_sequences_wait_in_order_and_base_requests_pass_them(llama):
    engine = make_engine(llama, ["a0", "a1"], max_loras=1)
    engine.add_request("first", prompt_token_ids=PROMPTS[0], sampling_params=GREEDY, lora="a0")
    engine.add_request("second", prompt_token_ids=PROMPTS[1], sampling_params=GREEDY, lora="a1")
    engine.add_request("base", prompt_token_ids=PROMPTS[2], sampling_params=GREEDY)
    engine.step()
    running = {s.request.request_id for s in engine.scheduler.running if s.request is not None}
    assert running == {"first", "base"}  # a1 waits for the one slot; the base request does not
    assert [s.request.request_id for s in engine.scheduler.waiting if s.request is not None] == ["second"]
    assert engine.scheduler.waiting[0].status is SequenceStatus.WAITING
    done = run_all(engine)
    assert done["second"] == llama["refs"]["a1"][1] and done["first"] == llama["refs"]["a0"][0]


def test_a_lone_request_waits_for_its_background_load(llama):
    engine = make_engine(llama, ["a0", "a1"], max_loras=1, max_cpu_loras=1)
    manager = engine.lora
    assert manager is not None and list(manager.host) == ["a1"] and manager.num_loads == 2
    engine.add_request("x", prompt_token_ids=PROMPTS[3], sampling_params=GREEDY, lora="a0")
    assert engine.step() == [] and engine.num_running == 0  # nothing to run until a0 is read again
    done = run_all(engine)
    assert done["x"] == llama["refs"]["a0"][3] and manager.num_loads == 3
    assert engine.resident_adapters() == ["a0"] and list(manager.host) == ["a0"]


def test_llm_generate_takes_a_lora_request_per_prompt(llama):
    from batchinfer import LLM

    llm = LLM(str(llama["base"]), num_kv_blocks=64, enable_lora=True)
    a0, rs = (LoRARequest(name, i + 1, llama["paths"][name]) for i, name in enumerate(("a0", "rs")))
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    picks = [a0, None, rs, a0][:len(prompts)]
    outs = llm.generate(prompts, GREEDY, lora_request=picks)
    for p, (out, lr) in enumerate(zip(outs, picks, strict=True)):
        assert out.outputs[0].token_ids == llama["refs"][None if lr is None else lr.lora_name][p]
    # one adapter for every prompt
    outs = llm.generate(prompts, GREEDY, lora_request=rs)
    assert [o.outputs[0].token_ids for o in outs] == llama["refs"]["rs"]
    with pytest.raises(ValueError, match="lora_request: 1 given for"):
        llm.generate(prompts, GREEDY, lora_request=[a0])
    with pytest.raises(ValueError, match="served from"):  # the same name from another folder
        llm.generate(prompts, GREEDY, lora_request=LoRARequest("a0", 1, llama["paths"]["a1"]))
    plain = LLM(str(llama["base"]), num_kv_blocks=16)
    with pytest.raises(ValueError, match=r"prompts\[0\]: lora: .*serves no adapters"):
        plain.generate(prompts, GREEDY, lora_request=a0)
