"""``load_adapter`` on adapters PEFT itself made (tests/lora_cases.py): the layout against PEFT's
tensors and PEFT's own forward, scalings (plain, rsLoRA, rank / alpha patterns), dtypes, Phi-3's
fused targets, and every refusal with its message."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest
import torch
from lora_cases import (
    ALL_TARGETS,
    PHI3_TARGETS,
    PROMPTS,
    edit_adapter_config,
    edit_adapter_tensors,
    make_base,
    make_peft_adapter,
    peft_greedy,
    peft_lora_modules,
    peft_tensors,
)

from batchinfer.workers.lora.adapter import GROUP_SLICES, LoRAAdapter, load_adapter, lora_groups
from batchinfer.workers.models.model_config import ModelConfig

pytest.importorskip("peft")

PREFIX = "base_model.model.model.layers"
# Our group -> (PEFT module names under layers.N. filling its slices, in slice order)
UNFUSED = {"qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
           "o_proj": ("self_attn.o_proj",),
           "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
           "down_proj": ("mlp.down_proj",)}
# PEFT module under layers.N. -> (our group, the slices it fills); the fused ones fill all.
SLOTS = {**{sub: (g, (i,)) for g, subs in UNFUSED.items() for i, sub in enumerate(subs)},
         "self_attn.qkv_proj": ("qkv_proj", (0, 1, 2)), "mlp.gate_up_proj": ("gate_up_proj", (0, 1))}


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-bases")
    return {"llama": make_base(root / "llama", "LlamaForCausalLM"),
            "qwen2": make_base(root / "qwen2", "Qwen2ForCausalLM", seed=1),
            "phi3": make_base(root / "phi3", "Phi3ForCausalLM", seed=2)}


def load(adapter: Path, base: Path, max_rank: int = 64, dtype: torch.dtype = torch.float32,
         config: ModelConfig | None = None) -> LoRAAdapter:
    return load_adapter("ad", adapter, config or ModelConfig.from_dir(base), max_rank=max_rank, dtype=dtype)


def refusal(adapter: Path, base: Path, **kwargs) -> str:
    """The message of the ValueError loading ``adapter`` raises; every one names the adapter and its path."""
    with pytest.raises(ValueError) as err:
        load(adapter, base, **kwargs)
    message = str(err.value)
    assert message.startswith(f"lora adapter 'ad' ({adapter}): "), message
    return message


def check_against_peft(adapter: LoRAAdapter, base: Path, adapter_dir: Path,
                       dtype: torch.dtype = torch.float32) -> None:
    """Every PEFT module's A is its slice rows of our A, its B * scaling the first r columns of our B
    slice (zeros beyond), from PEFT's own loaded model (its r and scaling per module)."""
    config = ModelConfig.from_dir(base)
    R = adapter.rank
    seen = set()
    for name, module in peft_lora_modules(base, adapter_dir).items():
        match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        assert match is not None, name
        layer, sub = match.groups()
        group, slices = SLOTS[sub]
        info = next(g for g in lora_groups(config, int(layer)) if g.name == group)
        a_ref = module.lora_A["default"].weight.detach()  # [r, in]
        b_ref = module.lora_B["default"].weight.detach().float() * module.scaling["default"]  # [sum out, r]
        r = module.r["default"]
        big_a, bs = adapter.weights[(int(layer), group)]
        row = 0
        for i in slices:
            out = info.out_features[i]
            assert torch.equal(big_a[i * R:i * R + r], a_ref.to(dtype)), (name, i)
            assert not big_a[i * R + r:(i + 1) * R].any(), (name, i, "A padding")
            assert torch.equal(bs[i][:, :r], b_ref[row:row + out].to(dtype)), (name, i)
            assert not bs[i][:, r:].any(), (name, i, "B padding")
            row += out
            seen.add((int(layer), group, i))
    for (layer, group), (big_a, bs) in adapter.weights.items():
        assert big_a.dtype == dtype and big_a.device.type == "cpu"
        info = next(g for g in lora_groups(config, layer) if g.name == group)
        assert big_a.shape == (len(info.slices) * R, info.in_features)
        assert [tuple(b.shape) for b in bs] == [(out, R) for out in info.out_features]
        for i in range(len(info.slices)):
            if (layer, group, i) not in seen:  # an untargeted slice: zeros
                assert not big_a[i * R:(i + 1) * R].any() and not bs[i].any(), (layer, group, i)
    assert {(layer, group) for layer, group, _ in seen} == set(adapter.weights)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_every_target_equals_peft_tensors(bases, tmp_path, arch):
    adapter_dir = make_peft_adapter(bases[arch], tmp_path / "a", r=8, alpha=16, seed=3)
    adapter = load(adapter_dir, bases[arch])
    assert adapter.rank == 8 and adapter.scaling == 2.0 and adapter.name == "ad"
    assert adapter.path == str(adapter_dir) and adapter.base_model == str(bases[arch])
    assert set(adapter.weights) == {(layer, g) for layer in range(2) for g in GROUP_SLICES}
    # The raw file, by hand: q_proj of layer 1 is slice 0, k slice 1; B carries alpha / r = 2.
    raw = peft_tensors(adapter_dir)
    big_a, (bq, bk, bv) = adapter.weights[(1, "qkv_proj")]
    assert torch.equal(big_a[8:16], raw[f"{PREFIX}.1.self_attn.k_proj.lora_A.weight"])
    assert torch.equal(bq, raw[f"{PREFIX}.1.self_attn.q_proj.lora_B.weight"] * 2)
    assert torch.equal(bv, raw[f"{PREFIX}.1.self_attn.v_proj.lora_B.weight"] * 2)
    assert bq.shape == (64, 8) and bk.shape == (32, 8)  # 4 heads, 2 KV heads of 16
    check_against_peft(adapter, bases[arch], adapter_dir)
    nbytes = sum(a.numel() * 4 + sum(b.numel() * 4 for b in bs) for a, bs in adapter.weights.values())
    assert adapter.nbytes == nbytes


def test_some_targets_leave_zero_slices_and_absent_groups(bases, tmp_path):
    adapter_dir = make_peft_adapter(bases["llama"], tmp_path / "a", targets=("q_proj", "v_proj", "down_proj"))
    adapter = load(adapter_dir, bases["llama"])
    assert set(adapter.weights) == {(layer, g) for layer in range(2) for g in ("qkv_proj", "down_proj")}
    big_a, (bq, bk, bv) = adapter.weights[(0, "qkv_proj")]
    assert big_a[:8].any() and not big_a[8:16].any() and big_a[16:].any()
    assert bq.any() and not bk.any() and bv.any()
    check_against_peft(adapter, bases["llama"], adapter_dir)


def test_adapter_changes_greedy_tokens(bases, tmp_path):
    """The helpers' random adapters visibly change outputs (a zero B would test nothing)."""
    adapter_dir = make_peft_adapter(bases["llama"], tmp_path / "a")
    base = peft_greedy(bases["llama"], None, PROMPTS, 6)
    tuned = peft_greedy(bases["llama"], adapter_dir, PROMPTS, 6)
    assert all(len(t) == 6 for t in base + tuned)
    assert sum(a != b for a, b in zip(base, tuned, strict=True)) >= len(PROMPTS) - 1, (base, tuned)


def test_delta_equals_peft_forward(bases, tmp_path):
    """Our layout's B_i (A_i x) for every slice, side by side, equals PEFT's module output minus its
    base layer's: the fused order q, k, v / gate, up, padding and scaling all at once."""
    adapter_dir = make_peft_adapter(bases["llama"], tmp_path / "a", r=4, alpha=8,
                                    rank_pattern={"k_proj": 2, "down_proj": 6}, seed=5)
    adapter = load(adapter_dir, bases["llama"])
    modules = peft_lora_modules(bases["llama"], adapter_dir)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))  # [T, C]
    xd = torch.randn(5, 128, generator=torch.Generator().manual_seed(1))  # [T, I]
    R = adapter.rank
    assert R == 6
    for layer in range(2):
        for group, subs in UNFUSED.items():
            inp = xd if group == "down_proj" else x
            big_a, bs = adapter.weights[(layer, group)]
            ours = torch.cat([(inp @ big_a[i * R:(i + 1) * R].T) @ b.T for i, b in enumerate(bs)], dim=1)
            with torch.no_grad():
                ref = torch.cat([modules[f"model.layers.{layer}.{s}"](inp)
                                 - modules[f"model.layers.{layer}.{s}"].base_layer(inp) for s in subs], dim=1)
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_rslora_scaling(bases, tmp_path):
    adapter_dir = make_peft_adapter(bases["qwen2"], tmp_path / "a", r=8, alpha=16, rslora=True)
    adapter = load(adapter_dir, bases["qwen2"])
    assert adapter.scaling == pytest.approx(16 / math.sqrt(8))
    raw = peft_tensors(adapter_dir)
    b = raw[f"{PREFIX}.0.mlp.up_proj.lora_B.weight"]
    assert torch.equal(adapter.weights[(0, "gate_up_proj")][1][1], b * (16 / math.sqrt(8)))
    check_against_peft(adapter, bases["qwen2"], adapter_dir)


@pytest.mark.parametrize("rslora", [False, True], ids=["plain", "rslora"])
def test_rank_and_alpha_patterns(bases, tmp_path, rslora):
    """PEFT's matching (peft 0.21 get_pattern_key): the first key matching the end of the module name
    at a '.' boundary, as a regex; 'proj' matches nothing (no boundary before it)."""
    rank_pattern = {"proj": 32, r"layers\.1\.self_attn\.(q|k)_proj": 12, "v_proj": 2,
                    "model.layers.0.mlp.down_proj": 16}
    alpha_pattern = {"q_proj": 40, "down_proj": 3}
    adapter_dir = make_peft_adapter(bases["llama"], tmp_path / "a", r=4, alpha=8, rslora=rslora,
                                    rank_pattern=rank_pattern, alpha_pattern=alpha_pattern, seed=7)
    adapter = load(adapter_dir, bases["llama"])
    assert adapter.rank == 16  # layers.0's down_proj; "proj" (32) matched nothing
    assert adapter.scaling == pytest.approx(8 / (2 if rslora else 4))
    modules = peft_lora_modules(bases["llama"], adapter_dir)
    assert modules["model.layers.1.self_attn.k_proj"].r["default"] == 12
    assert modules["model.layers.0.self_attn.k_proj"].r["default"] == 4
    check_against_peft(adapter, bases["llama"], adapter_dir)
    raw = peft_tensors(adapter_dir)
    q_b = raw[f"{PREFIX}.1.self_attn.q_proj.lora_B.weight"]  # r 12, alpha 40
    scaling = 40 / (math.sqrt(12) if rslora else 12)
    assert torch.equal(adapter.weights[(1, "qkv_proj")][1][0][:, :12], q_b * scaling)


def test_bfloat16(bases, tmp_path):
    adapter_dir = make_peft_adapter(bases["llama"], tmp_path / "a", r=8, alpha=12)
    adapter = load(adapter_dir, bases["llama"], dtype=torch.bfloat16)
    check_against_peft(adapter, bases["llama"], adapter_dir, dtype=torch.bfloat16)
    b = peft_tensors(adapter_dir)[f"{PREFIX}.0.self_attn.o_proj.lora_B.weight"]
    assert torch.equal(adapter.weights[(0, "o_proj")][1][0], (b * 1.5).to(torch.bfloat16))
    assert adapter.nbytes == sum(a.numel() * 2 + sum(x.numel() * 2 for x in bs)
                                 for a, bs in adapter.weights.values())


def test_phi3_fused_targets(bases, tmp_path):
    """Phi-3's qkv_proj pair: one A in every slice of our group, B split by rows into q (64), k, v (32)."""
    adapter_dir = make_peft_adapter(bases["phi3"], tmp_path / "a", r=8, alpha=16, targets=PHI3_TARGETS)
    adapter = load(adapter_dir, bases["phi3"])
    raw = peft_tensors(adapter_dir)
    a = raw[f"{PREFIX}.1.self_attn.qkv_proj.lora_A.weight"]
    b = raw[f"{PREFIX}.1.self_attn.qkv_proj.lora_B.weight"] * 2  # [128, 8]
    big_a, (bq, bk, bv) = adapter.weights[(1, "qkv_proj")]
    assert torch.equal(big_a, torch.cat([a, a, a]))
    assert torch.equal(bq, b[:64]) and torch.equal(bk, b[64:96]) and torch.equal(bv, b[96:])
    a = raw[f"{PREFIX}.0.mlp.gate_up_proj.lora_A.weight"]
    b = raw[f"{PREFIX}.0.mlp.gate_up_proj.lora_B.weight"] * 2  # [256, 8]
    big_a, (bg, bu) = adapter.weights[(0, "gate_up_proj")]
    assert torch.equal(big_a, torch.cat([a, a])) and torch.equal(bg, b[:128]) and torch.equal(bu, b[128:])
    check_against_peft(adapter, bases["phi3"], adapter_dir)
    assert set(adapter.weights) == {(layer, g) for layer in range(2) for g in GROUP_SLICES}


def test_adapter_name_infix_in_keys(bases, tmp_path):
    """Tools that keep the adapter name in the keys (``lora_A.default.weight``) load the same."""
    adapter_dir = make_peft_adapter(bases["llama"], tmp_path / "a", targets=("q_proj", "up_proj"))
    plain = load(adapter_dir, bases["llama"])
    raw = peft_tensors(adapter_dir)
    renamed = {k.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default."): t
               for k, t in raw.items()}
    edit_adapter_tensors(adapter_dir, {**dict.fromkeys(raw), **renamed})
    assert all(".default.weight" in k for k in peft_tensors(adapter_dir))
    infixed = load(adapter_dir, bases["llama"])
    assert plain.weights.keys() == infixed.weights.keys()
    for key, (a, bs) in plain.weights.items():
        assert torch.equal(a, infixed.weights[key][0])
        assert all(torch.equal(x, y) for x, y in zip(bs, infixed.weights[key][1], strict=True))


# -- refusals -------------------------------------------------------------------------------------

@pytest.mark.parametrize(("changes", "expected"), [
    ({"peft_type": "IA3"}, "peft_type is 'IA3'; only 'LORA'"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"use_dora": True}, "use_dora (DoRA"),
    ({"bias": "all"}, "bias='all'"),
    ({"fan_in_fan_out": True}, "fan_in_fan_out"),
    ({"lora_bias": True}, "lora_bias"),
    ({"layer_replication": [[0, 2], [1, 2]]}, "layer_replication"),
    ({"r": 4}, "has rank 8, but adapter_config.json gives r=4 for 'model.layers.0."),
    ({"r": 0}, "r must be a positive integer, got 0"),
    ({"r": 2.5}, "r must be a positive integer, got 2.5"),
    ({"lora_alpha": "16"}, "lora_alpha must be a positive number, got '16'"),
    ({"rank_pattern": {"q_proj": 2.5}}, "rank_pattern must map module names to positive integers"),
    ({"alpha_pattern": {"(q_proj": 4}}, "alpha_pattern key '(q_proj' is not a regular expression"),
], ids=["ia3", "modules_to_save", "dora", "bias", "fan_in_fan_out", "lora_bias", "layer_replication",
        "r_mismatch", "r_zero", "r_fraction", "alpha_string", "rank_pattern_type", "pattern_regex"])
def test_config_refusals(bases, tmp_path, changes, expected):
    adapter_dir = make_peft_adapter(bases["llama"], tmp_path / "a", targets=("q_proj", "down_proj"))
    edit_adapter_config(adapter_dir, **changes)
    assert expected in refusal(adapter_dir, bases["llama"])


def test_rank_above_max_rank(bases, tmp_path):
    adapter_dir = make_peft_adapter(bases["llama"], tmp_path / "a", r=4, rank_pattern={"o_proj": 16})
    message = refusal(adapter_dir, bases["llama"], max_rank=8)
    assert "rank 16 is above the limit of 8" in message
    assert "max_lora_rank" in message and "--max-lora-rank" in message
    assert load(adapter_dir, bases["llama"], max_rank=16).rank == 16


def test_adapter_for_another_base_model(bases, tmp_path):
    other = make_base(tmp_path / "wide", "LlamaForCausalLM", hidden_size=96)
    adapter_dir = make_peft_adapter(other, tmp_path / "a", targets=("q_proj",))
    message = refusal(adapter_dir, bases["llama"])
    key = f"{PREFIX}.0.self_attn.q_proj.lora_A.weight"
    assert f"tensor '{key}' has shape (8, 96), the base model needs (8, 64)" in message
    assert "is this adapter for another base model?" in message


def test_layer_beyond_the_base_model(bases, tmp_path):
    deep = make_base(tmp_path / "deep", "LlamaForCausalLM", num_hidden_layers=3)
    adapter_dir = make_peft_adapter(deep, tmp_path / "a", targets=("v_proj",), layers_to_transform=[2])
    message = refusal(adapter_dir, bases["llama"])
    assert f"tensor '{PREFIX}.2.self_attn.v_proj.lora_A.weight' is for layer 2" in message
    assert "the base model has 2 layers" in message


@pytest.mark.parametrize(("targets", "expected"), [
    (("lm_head",), "targets 'lm_head', which cannot be served; supported targets: q_proj, k_proj"),
    (("embed_tokens",), "is a LoRA on an embedding layer"),
], ids=["lm_head", "embed_tokens"])
def test_unsupported_modules(bases, tmp_path, targets, expected):
    adapter_dir = make_peft_adapter(bases["llama"], tmp_path / "a", targets=("q_proj", *targets))
    assert expected in refusal(adapter_dir, bases["llama"])


def test_unknown_module_inside_a_layer(bases, tmp_path):
    adapter_dir = make_peft_adapter(bases["llama"], tmp_path / "a", targets=("q_proj",))
    a = peft_tensors(adapter_dir)[f"{PREFIX}.0.self_attn.q_proj.lora_A.weight"]
    edit_adapter_tensors(adapter_dir, {f"{PREFIX}.0.self_attn.rotary.lora_A.weight": a})
    assert "targets 'self_attn.rotary', which cannot be served" in refusal(adapter_dir, bases["llama"])


def test_a_tensor_that_is_no_lora_weight(bases, tmp_path):
    adapter_dir = make_peft_adapter(bases["llama"], tmp_path / "a", targets=("q_proj",))
    key = f"{PREFIX}.0.self_attn.q_proj.lora_B.bias"
    edit_adapter_tensors(adapter_dir, {key: torch.zeros(64)})
    assert f"tensor '{key}' is not a LoRA A/B weight" in refusal(adapter_dir, bases["llama"])


def test_mlp_target_on_a_moe_layer(bases, tmp_path):
    config = dataclasses.replace(ModelConfig.from_dir(bases["llama"]), moe_layers=(1,))
    attention = make_peft_adapter(bases["llama"], tmp_path / "attn", targets=("q_proj", "o_proj"))
    assert set(load(attention, bases["llama"], config=config).weights) == {
        (layer, g) for layer in range(2) for g in ("qkv_proj", "o_proj")}
    mlp = make_peft_adapter(bases["llama"], tmp_path / "mlp", targets=("q_proj", "up_proj"))
    message = refusal(mlp, bases["llama"], config=config)
    assert f"tensor '{PREFIX}.1.mlp.up_proj.lora_A.weight' targets 'mlp.up_proj' of layer 1, " \
           "a mixture-of-experts layer" in message


@pytest.mark.parametrize("missing", ["lora_A", "lora_B"])
def test_half_a_pair(bases, tmp_path, missing):
    adapter_dir = make_peft_adapter(bases["llama"], tmp_path / "a", targets=("q_proj", "k_proj"))
    edit_adapter_tensors(adapter_dir, {f"{PREFIX}.1.self_attn.k_proj.{missing}.weight": None})
    message = refusal(adapter_dir, bases["llama"])
    assert f"has no {missing} partner ({missing} of layers.1.self_attn.k_proj is missing)" in message


def test_two_modules_for_one_slice(bases, tmp_path):
    adapter_dir = make_peft_adapter(bases["llama"], tmp_path / "a", targets=("q_proj", "k_proj", "v_proj"))
    raw = peft_tensors(adapter_dir)
    p = f"{PREFIX}.0.self_attn."
    fused_b = torch.cat([raw[p + f"{n}_proj.lora_B.weight"] for n in "qkv"])
    edit_adapter_tensors(adapter_dir, {p + "qkv_proj.lora_A.weight": raw[p + "q_proj.lora_A.weight"],
                                       p + "qkv_proj.lora_B.weight": fused_b})
    assert "both target the q_proj part of layer 0's qkv_proj" in refusal(adapter_dir, bases["llama"])


def test_empty_adapter(bases, tmp_path):
    adapter_dir = make_peft_adapter(bases["llama"], tmp_path / "a", targets=("q_proj",))
    edit_adapter_tensors(adapter_dir, dict.fromkeys(peft_tensors(adapter_dir)))
    assert "adapter_model.safetensors holds no LoRA tensors" in refusal(adapter_dir, bases["llama"])


def test_files_missing_or_unreadable(bases, tmp_path):
    base = bases["llama"]
    assert "not a folder" in refusal(tmp_path / "nowhere", base)
    adapter_dir = make_peft_adapter(base, tmp_path / "a", targets=("q_proj",))
    weights = adapter_dir / "adapter_model.safetensors"
    weights.rename(adapter_dir / "saved")
    (adapter_dir / "adapter_model.bin").write_bytes(b"not unpickled")
    message = refusal(adapter_dir, base)
    assert "only adapter_model.safetensors is read" in message and "adapter_model.bin" in message
    (adapter_dir / "adapter_model.bin").unlink()
    assert refusal(adapter_dir, base).endswith("no adapter_model.safetensors")
    weights.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00garbage!")
    assert "adapter_model.safetensors cannot be read" in refusal(adapter_dir, base)
    (adapter_dir / "adapter_config.json").write_text("{not json", encoding="utf-8")
    assert "adapter_config.json cannot be read" in refusal(adapter_dir, base)
    (adapter_dir / "adapter_config.json").write_text(json.dumps([1]), encoding="utf-8")
    assert "adapter_config.json is not a JSON object" in refusal(adapter_dir, base)
    (adapter_dir / "adapter_config.json").unlink()
    assert "no adapter_config.json" in refusal(adapter_dir, base)


def test_targets_constant_matches_groups():
    """Every PEFT module name the loader accepts is a slice of some group (or a fused group)."""
    assert set(ALL_TARGETS) == {s for slices in GROUP_SLICES.values() for s in slices}
    assert set(PHI3_TARGETS) == set(GROUP_SLICES)
