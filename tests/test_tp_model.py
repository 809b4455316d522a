"""Tensor-parallel sharding of the decoder (issue 17): TP=2 over gloo against TP=1, on the CPU.

One spawn of two rank processes (``torch.multiprocessing``, spawn context, a free port) runs
every check: each rank joins a ``TPGroup``, loads each tiny checkpoint sharded, drives the same
paged workload (chunked prefill then decode steps over a shuffled paged cache) and writes its
logits and parameter bytes to files; this process compares them with the unsharded decoder.
Refusals of configs a size cannot split need no processes (the decoder checks them at build).
"""

from __future__ import annotations

import dataclasses
import socket
from pathlib import Path

import pytest
import torch
from tp_ranks import paged_logits, param_bytes, rank_main

from batchinfer.workers.models import Decoder, ModelConfig, load_model
from batchinfer.workers.models.sharding import ShardPlan
from batchinfer.workers.models.tiny import make_tiny_model
from batchinfer.workers.parallel.group import TPGroup, TPGroupError

ATOL = 1e-4
SIZE = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the checkpoints ------------------------------------------------------------------------------

def _checkpoints(root: Path) -> dict[str, Path]:
    """Tiny checkpoints covering every sharded feature (transformers-written ones when it imports)."""
    models = {
        "llama": make_tiny_model(root / "llama", "LlamaForCausalLM", shards=2),  # 4 heads, 2 KV heads
        "qwen2": make_tiny_model(root / "qwen2", "Qwen2ForCausalLM"),  # q/k/v bias, tied embedding
        "qwen3": make_tiny_model(root / "qwen3", "Qwen3ForCausalLM"),  # q/k norms, head_dim 32
        # One KV head for two ranks (replicated), o_proj and MLP biases (added once), vocab 321
        # (the last rank's LM head rows padded).
        "gqa": make_tiny_model(root / "gqa", "LlamaForCausalLM", seed=3, num_key_value_heads=1,
                               attention_bias=True, mlp_bias=True, vocab_size=321),
    }
    try:
        import transformers  # noqa: F401
    except ImportError:
        return models
    from moe_models import make_tiny_moe_model
    from test_gemma import make_gemma
    from test_phi3 import make_tiny_phi3

    models["gemma2"] = make_gemma(root / "gemma2", "gemma2")[0]  # soft-caps, scaled embedding, GeGLU
    models["gemma3"] = make_gemma(root / "gemma3", "gemma3")[0]  # q/k norms, two RoPE tables
    models["phi3"] = make_tiny_phi3(root / "phi3", 512)  # fused qkv_proj / gate_up_proj tensors
    models["qwen2moe"] = make_tiny_moe_model(root / "qwen2moe", "Qwen2MoeForCausalLM")  # shared expert
    models["qwen3moe"] = make_tiny_moe_model(root / "qwen3moe", "Qwen3MoeForCausalLM")  # + a dense layer
    models["mixtral"] = make_tiny_moe_model(root / "mixtral", "MixtralForCausalLM")
    try:
        import gguf
        from gguf_helpers import gguf_folder

        # Llama's q/k rows come back un-permuted (whole tensors) before the rank's rows are cut.
        hf = make_tiny_model(root / "llama-hf", "LlamaForCausalLM", seed=1)
        models["gguf"] = gguf_folder(hf, root / "llama-gguf", gguf.GGMLQuantizationType.Q8_0)
    except ImportError:
        pass
    return models


def _spawn(size: int, models: dict[str, Path], out: Path) -> tuple[list[dict], str | None]:
    """Run ``tp_ranks.rank_main`` on ``size`` spawned ranks: (each rank's results, the dead-peer message)."""
    out.mkdir()
    ctx = torch.multiprocessing.get_context("spawn")
    args = (size, _free_port(), {k: str(v) for k, v in models.items()}, str(out))
    procs = [ctx.Process(target=rank_main, args=(rank, *args), daemon=True) for rank in range(size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    errors = [f.read_text() for f in sorted(out.glob("*.error"))]
    assert not errors, "\n".join(errors)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(size)]
    dead = out / "dead_peer.txt"
    return ranks, dead.read_text() if dead.is_file() else None


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    """(checkpoints, each rank's results, the dead-peer message) of one spawn of two ranks."""
    root = tmp_path_factory.mktemp("tp")
    models = _checkpoints(root)
    return models, *_spawn(SIZE, models, root / "out")


@pytest.fixture(scope="module")
def tp4_run(tmp_path_factory):
    """Four ranks over 8 q heads and 2 KV heads: each KV head replicated on two ranks, rank r
    holding KV head r // 2 (a wrong choice reads another group's keys)."""
    root = tmp_path_factory.mktemp("tp4")
    models = {"gqa4": make_tiny_model(root / "gqa4", "LlamaForCausalLM", seed=5, num_attention_heads=8,
                                      num_key_value_heads=2, attention_bias=True)}
    return models, *_spawn(4, models, root / "out")


# -- the checks -----------------------------------------------------------------------------------

@pytest.mark.parametrize("run", ["tp_run", "tp4_run"])
def test_collectives(request, run):
    _, ranks, _ = request.getfixturevalue(run)
    size = len(ranks)
    for r in ranks:
        assert torch.equal(r["all_reduce"], torch.full((2, 3), size * (size + 1) / 2))
        assert torch.equal(r["all_gather"], torch.arange(size, dtype=torch.float32).expand(2, size))
        assert r["broadcast"].tolist() == [5]
        assert r["min_int"] == 100 - 7 * (size - 1)


@pytest.mark.parametrize("run", ["tp_run", "tp4_run"])
def test_a_dead_peer_raises_instead_of_hanging(request, run):
    _, ranks, dead = request.getfixturevalue(run)
    assert dead is not None and f"all_reduce failed on rank 0 of {len(ranks)}" in dead


NAMES = ["llama", "qwen2", "qwen3", "gqa", "gemma2", "gemma3", "phi3", "qwen2moe", "qwen3moe", "mixtral",
         "gguf"]


@pytest.mark.parametrize("name", NAMES + ["gqa4"])
def test_tp_logits_equal_tp1(request, name):
    models, ranks, _ = request.getfixturevalue("tp4_run" if name == "gqa4" else "tp_run")
    if name not in models:
        pytest.skip(f"{name}: its builder needs transformers / gguf")
    ref = paged_logits(load_model(models[name], progress=False))
    assert ref.shape[1] == ModelConfig.from_dir(models[name]).vocab_size
    assert torch.isfinite(ref).all()
    for r in ranks:  # every rank gets the full logits
        got = r[name]["logits"]
        assert got.shape == ref.shape
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
    for r in ranks[1:]:  # identical on every rank
        assert torch.equal(r[name]["logits"], ranks[0][name]["logits"])


def expected_rank_bytes(model: Decoder, size: int) -> float:
    """Parameter bytes of one rank's shard of ``model`` (unsharded): 1/N of everything, except what
    every rank holds whole (norms, routers, row-parallel biases) and, with fewer KV heads than
    ranks, the one KV head each rank holds whole."""
    c, itemsize = model.config, model.dtype.itemsize
    replicated = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                     if "norm" in name or name.endswith(("mlp.gate.weight", "shared_expert_gate.weight",
                                                         "o_proj.bias", "down_proj.bias")))
    kv_full = c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * (c.hidden_size + c.qkv_bias)
    kv_local = kv_full / c.num_key_value_heads if c.num_key_value_heads < size else kv_full / size
    rest = param_bytes(model) - replicated - kv_full * itemsize
    return replicated + rest / size + kv_local * itemsize


@pytest.mark.parametrize("name", ["llama", "gqa", "qwen3", "qwen2moe", "mixtral", "gqa4"])
def test_each_rank_holds_its_share_of_the_weights(request, name):
    models, ranks, _ = request.getfixturevalue("tp4_run" if name == "gqa4" else "tp_run")
    if name not in models:
        pytest.skip(f"{name}: its builder needs transformers")
    size = len(ranks)
    full = load_model(models[name], progress=False)
    whole = param_bytes(full)
    expected = expected_rank_bytes(full, size)
    c = full.config
    pad = (-c.vocab_size % size) * c.hidden_size * full.dtype.itemsize * (1 if c.tie_word_embeddings else 2)
    for r in ranks:
        got = r[name]["bytes"]
        assert abs(got - expected) <= 0.01 * whole + pad, (got, expected, whole)
        assert got < 1.2 * whole / size
        # The KV cache: each rank its own heads (one replicated head when KVH < ranks).
        assert r[name]["kv_heads"] == max(1, c.num_key_value_heads // size)
        assert r[name]["kv_bytes"] == full.kv_cache_bytes_per_token() * r[name]["kv_heads"] \
            // c.num_key_value_heads


# -- refusals (no processes needed: the plan is checked when the decoder is built) ------------------

def _fake_group(size: int, rank: int = 0) -> TPGroup:
    return TPGroup(rank=rank, size=size, device=torch.device("cpu"))  # no process group: never called


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("refuse") / "m", "LlamaForCausalLM")


@pytest.mark.parametrize(("overrides", "size", "message"), [
    ({}, 3, "does not divide num_attention_heads 4"),
    ({"num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 96}, 2,
     "does not divide num_key_value_heads 3"),
    ({"num_attention_heads": 6, "num_key_value_heads": 2, "hidden_size": 96}, 3,
     "not a multiple of num_key_value_heads 2"),
    ({"intermediate_size": 130}, 4, "does not divide intermediate_size 130"),
])
def test_indivisible_configs_are_refused_at_load(tmp_path, overrides, size, message):
    path = make_tiny_model(tmp_path / "m", "LlamaForCausalLM", **overrides)
    with pytest.raises(ValueError, match=message):
        load_model(path, tp=_fake_group(size), progress=False)


def test_moe_intermediate_must_divide():
    config = ModelConfig(architecture="MixtralForCausalLM", vocab_size=320, hidden_size=64,
                         intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                         num_experts=4, num_experts_per_tok=2, moe_intermediate_size=50, moe_layers=(0, 1))
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        ShardPlan.build(config, 0, 4)
    ShardPlan.build(dataclasses.replace(config, moe_intermediate_size=48), 0, 4)  # 48 / 4: fine


def test_single_group_is_the_unsharded_decoder(llama_dir):
    one = load_model(llama_dir, progress=False)
    single = load_model(llama_dir, tp=TPGroup.single(), progress=False)
    assert single.tp is None and single.shard is None
    assert torch.equal(paged_logits(one), paged_logits(single))
    g = TPGroup.single()
    x = torch.ones(3)
    assert g.all_reduce(x) is x and g.all_gather(x) is x and g.all_reduce_min_int(4) == 4


def test_group_init_errors(llama_dir):
    with pytest.raises(ValueError, match="backend 'mpi'"):
        TPGroup.init(0, 2, "tcp://127.0.0.1:1", backend="mpi")
    with pytest.raises(ValueError, match="rank 2 is out of range"):
        TPGroup.init(2, 2, "tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match="nccl backend needs a CUDA device"):
        TPGroup.init(0, 2, "tcp://127.0.0.1:1", backend="nccl", device="cpu")


def test_a_taken_port_is_a_clear_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(TPGroupError, match=f"rendezvous failed for rank 0 of 2 at tcp://127.0.0.1:{port}"):
            TPGroup.init(0, 2, f"tcp://127.0.0.1:{port}", timeout_s=5)
    assert not torch.distributed.is_initialized()


def test_a_rank_reads_only_its_slices(tmp_path):
    """The sharded reader yields each rank its rows: about 1/N of the checkpoint's bytes."""
    from batchinfer.workers.models import loader

    path = make_tiny_model(tmp_path / "m", "LlamaForCausalLM", shards=2, attention_bias=True)
    config = ModelConfig.from_dir(path)
    files = loader.weight_files(path)
    whole = {name: t for _, name, t in loader._tensors(files)}
    total = sum(t.numel() * t.element_size() for t in whole.values())
    parts = []
    for rank in range(SIZE):
        plan = ShardPlan.build(config, rank, SIZE)
        read = {name: t for _, name, t in loader._sharded(loader._lazy_tensors(files), config, plan)}
        assert read.keys() == whole.keys()
        size = sum(t.numel() * t.element_size() for t in read.values())
        assert size < 0.52 * total  # norms and o_proj biases are read whole (~1%)
        q = "model.layers.1.self_attn.q_proj.weight"
        rows = config.num_attention_heads * config.head_dim // SIZE
        assert torch.equal(read[q], whole[q][rank * rows:(rank + 1) * rows])
        o = "model.layers.0.self_attn.o_proj.weight"
        assert torch.equal(read[o], whole[o][:, rank * rows:(rank + 1) * rows])
        parts.append(read["model.embed_tokens.weight"])
    assert torch.equal(torch.cat(parts), whole["model.embed_tokens.weight"])


def test_a_checkpoint_disagreeing_with_config_is_named_under_tp(tmp_path):
    import json

    path = make_tiny_model(tmp_path / "m", "LlamaForCausalLM")  # intermediate_size 128
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    with pytest.raises(ValueError, match=r"tensor 'model.layers.0.mlp.down_proj.weight' has shape "
                       r"\(64, 128\), expected 96 along dimension 1 from config.json"):
        load_model(path, tp=_fake_group(SIZE), progress=False)


def test_a_rendezvous_a_rank_never_joins_times_out():
    with pytest.raises(TPGroupError, match=r"rendezvous failed for rank 0 of 2 at tcp://127.0.0.1:"):
        TPGroup.init(0, 2, f"tcp://127.0.0.1:{_free_port()}", timeout_s=1)
    assert not torch.distributed.is_initialized()
