"""The decoder against transformers on tiny random checkpoints; loading, configs and their errors."""

from __future__ import annotations

import io
import json
import shutil
import sys

import pytest
import torch

from batchinfer.workers.models import Decoder, ModelConfig, load_model
from batchinfer.workers.models.attention import AttentionMetadata
from batchinfer.workers.models.tiny import make_tiny_model

transformers = pytest.importorskip("transformers")

ARCHITECTURES = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
ATOL = 1e-4


class PagedRun:
    """Drives a ``Decoder`` step by step over a paged cache, as the model runner does.

    Blocks are handed out from a shuffled pool so a sequence's blocks are not contiguous; the
    cache starts as NaN so reading a slot that was never written poisons the logits.
    """

    def __init__(self, model: Decoder, num_blocks: int = 96, block_size: int = 4, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.model, self.block_size = model, block_size
        self.free = torch.randperm(num_blocks, generator=gen).tolist()
        shape = (num_blocks, block_size, model.num_kv_heads, model.head_dim)
        self.caches = [(torch.full(shape, float("nan"), dtype=model.dtype),
                        torch.full(shape, float("nan"), dtype=model.dtype)) for _ in range(model.num_layers)]
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, chunks: list[tuple[int, list[int]]]) -> torch.Tensor:
        """Feed each (sequence id, new tokens) chunk in one forward; returns logits [T, V]."""
        ids, positions, slots, cu, seq_lens = [], [], [], [0], []
        for sid, tokens in chunks:
            start = self.lens.get(sid, 0)
            end = start + len(tokens)
            table = self.tables.setdefault(sid, [])
            while len(table) * self.block_size < end:
                table.append(self.free.pop())
            for pos in range(start, end):
                slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
            ids += tokens
            positions += range(start, end)
            cu.append(cu[-1] + len(tokens))
            seq_lens.append(end)
            self.lens[sid] = end
        width = max(len(self.tables[sid]) for sid, _ in chunks)
        tables = [self.tables[sid] + [0] * (width - len(self.tables[sid])) for sid, _ in chunks]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            max_seqlen_q=max(len(t) for _, t in chunks),
            max_seqlen_k=max(seq_lens),
            backend="reference",
        )
        with torch.no_grad():
            hidden = self.model(torch.tensor(ids), torch.tensor(positions), self.caches, meta)
            return self.model.compute_logits(hidden)


def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:  # [L, V]
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float()


def load_hf(model_dir, dtype=torch.float32):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    return model.eval()


def check_against_transformers(model_dir, lengths: list[int], decode_steps: int = 3, seed: int = 0):
    """Ragged prefill of all sequences in one forward, then mixed decode / chunk steps."""
    ours, theirs = load_model(model_dir, progress=False), load_hf(model_dir)
    gen = torch.Generator().manual_seed(seed)
    vocab = ours.config.vocab_size
    seqs = {i: torch.randint(0, vocab, (n,), generator=gen).tolist() for i, n in enumerate(lengths)}
    run = PagedRun(ours)

    logits = run.step(list(seqs.items()))
    offset = 0
    for tokens in seqs.values():
        expected = hf_logits(theirs, tokens)
        torch.testing.assert_close(logits[offset:offset + len(tokens)], expected, atol=ATOL, rtol=0)
        offset += len(tokens)

    for step in range(decode_steps):
        # Sequence 0 gets a 3-token chunk on the second step: prefill chunks and decodes share a batch.
        chunks = []
        for sid, tokens in seqs.items():
            n = 3 if (sid == 0 and step == 1) else 1
            new = torch.randint(0, vocab, (n,), generator=gen).tolist()
            tokens += new
            chunks.append((sid, new))
        logits = run.step(chunks)
        offset = 0
        for sid, new in chunks:
            expected = hf_logits(theirs, seqs[sid])[-len(new):]
            torch.testing.assert_close(logits[offset:offset + len(new)], expected, atol=ATOL, rtol=0)
            offset += len(new)
    return ours


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_logits_match_transformers(models_dir, architecture):
    model_dir = make_tiny_model(models_dir / architecture, architecture, seed=1)
    # 61 > Mistral's window of 48, so the sliding window is exercised.
    ours = check_against_transformers(model_dir, lengths=[5, 17, 1, 61, 9])
    assert ours.config.architecture == architecture


LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}  # small, so all three frequency bands occur
LINEAR_SCALING = {"rope_type": "linear", "factor": 4.0}


@pytest.mark.parametrize("scaling", [None, LINEAR_SCALING, LLAMA3_SCALING],
                         ids=["default", "linear", "llama3"])
def test_rope_table_matches_transformers(scaling):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from batchinfer.workers.models.rope import cos_sin_cache

    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16, rope_theta=5000.0,
                                      max_position_embeddings=256,
                                      rope_scaling=dict(scaling) if scaling else None)
    positions = torch.arange(256)[None]
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions)
    table = cos_sin_cache(256, 16, 5000.0, scaling)
    torch.testing.assert_close(table[:, :8], cos[0, :, :8], atol=1e-6, rtol=0)
    torch.testing.assert_close(table[:, 8:], sin[0, :, :8], atol=1e-6, rtol=0)
    if scaling:  # the scaling must actually change the table
        assert not torch.allclose(table, cos_sin_cache(256, 16, 5000.0, None))


@pytest.mark.parametrize("scaling", [LINEAR_SCALING, LLAMA3_SCALING], ids=["linear", "llama3"])
def test_rope_scaling_logits_match_transformers(models_dir, scaling):
    model_dir = make_tiny_model(models_dir / f"rope-{scaling['rope_type']}", rope_scaling=scaling)
    ours = check_against_transformers(model_dir, lengths=[70, 3], decode_steps=2)
    assert ours.config.rope_scaling["rope_type"] == scaling["rope_type"]


def test_sharded_checkpoint_loads_identically(tmp_path):
    single = load_model(make_tiny_model(tmp_path / "single", "Qwen2ForCausalLM", seed=3), progress=False)
    sharded_dir = make_tiny_model(tmp_path / "sharded", "Qwen2ForCausalLM", seed=3, shards=3)
    assert len(list(sharded_dir.glob("model-0000?-of-00003.safetensors"))) == 3
    assert not (sharded_dir / "model.safetensors").exists()
    sharded = load_model(sharded_dir, progress=False)
    a, b = single.state_dict(), sharded.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_close_to_float32(models_dir, dtype):
    """Our error against float32 stays within twice what transformers itself shows in that dtype."""
    model_dir = make_tiny_model(models_dir / "half", "Qwen3ForCausalLM", seed=2)
    tokens = torch.randint(0, 320, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    reference = hf_logits(load_hf(model_dir), tokens)
    model = load_model(model_dir, dtype=dtype, progress=False)
    assert model.dtype == dtype
    assert model.compute_logits(torch.zeros(1, 64, dtype=dtype)).dtype == torch.float32
    ours = PagedRun(model).step([(0, tokens)])
    theirs = hf_logits(load_hf(model_dir, dtype), tokens)
    ours_err, their_err = (ours - reference).abs().max(), (theirs - reference).abs().max()
    assert ours_err <= 2 * their_err + 0.02, (ours_err, their_err)


def test_auto_dtype_follows_checkpoint(tmp_path):
    model_dir = make_tiny_model(tmp_path / "bf16", torch_dtype="bfloat16")
    assert load_model(model_dir, dtype="auto", progress=False).dtype == torch.bfloat16
    assert load_model(model_dir, dtype="float32", progress=False).dtype == torch.float32
    with pytest.raises(ValueError, match="dtype 'int8' is not supported"):
        load_model(model_dir, dtype="int8", progress=False)


def test_progress_bar_on_a_terminal(tiny_llama, monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    for progress, shown in ((True, True), (False, False)):
        stderr = Terminal()
        monkeypatch.setattr(sys, "stderr", stderr)
        load_model(tiny_llama, progress=progress)
        assert ("loading weights" in stderr.getvalue()) is shown


def test_decoder_conveniences(tiny_llama):
    model = load_model(tiny_llama, progress=False)
    assert (model.num_layers, model.num_kv_heads, model.head_dim) == (2, 2, 16)
    assert model.kv_cache_bytes_per_token() == 2 * 2 * 2 * 16 * 4
    assert model.kv_cache_bytes_per_token(torch.bfloat16) == 2 * 2 * 2 * 16 * 2
    assert model.cos_sin_cache.shape == (512, 16)
    # q/k/v and gate/up are fused at load time.
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert attn.qkv_proj.weight.shape == ((4 + 2 + 2) * 16, 64)
    assert mlp.gate_up_proj.weight.shape == (2 * 128, 64)
    with pytest.raises(ValueError, match="kv_caches has 1 entries for 2 layers"):
        model(torch.tensor([1]), torch.tensor([0]), [None], None)


# --- errors ------------------------------------------------------------------------------------

def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_files(tiny_llama, tmp_path):
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        load_model(tmp_path / "nowhere")
    no_config = _copy(tiny_llama, tmp_path / "no-config")
    (no_config / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(no_config)
    no_weights = _copy(tiny_llama, tmp_path / "no-weights")
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors or model.safetensors.index.json"):
        load_model(no_weights)
    sharded = make_tiny_model(tmp_path / "sharded", shards=2)
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors: shard listed"):
        load_model(sharded)


def _rewrite_weights(model_dir, edit):
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def test_missing_unexpected_and_misshapen_tensors(tiny_llama, tmp_path):
    missing = _copy(tiny_llama, tmp_path / "missing")
    _rewrite_weights(missing, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.qkv_proj\.weight \(k part\)"):
        load_model(missing, progress=False)
    extra = _copy(tiny_llama, tmp_path / "extra")
    _rewrite_weights(extra, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}))
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.q_proj\.bias'"):
        load_model(extra, progress=False)
    shape = _copy(tiny_llama, tmp_path / "shape")
    _rewrite_weights(shape, lambda t: t.update({"model.norm.weight": torch.ones(65)}))
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' has shape \(65,\), expected \(64,\)"):
        load_model(shape, progress=False)


def _edit_config(model_dir, **changes):
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_unknown_architecture_and_unsupported_settings(tiny_llama, tmp_path):
    model_dir = _copy(tiny_llama, tmp_path / "m")
    # auto_map (remote code) is ignored: the architecture alone decides, and an unknown one is refused.
    _edit_config(model_dir, architectures=["GPT2LMHeadModel"], auto_map={"AutoModel": "evil.Model"})
    with pytest.raises(ValueError, match=r"unsupported architecture GPT2LMHeadModel; supported: Llama"):
        load_model(model_dir)
    _edit_config(model_dir, architectures=["LlamaForCausalLM"],
                 rope_scaling={"rope_type": "mrope", "factor": 2})
    with pytest.raises(ValueError, match="rope scaling type 'mrope' is not supported; supported: default"):
        load_model(model_dir)
    _edit_config(model_dir, rope_scaling={"rope_type": "linear"})
    with pytest.raises(ValueError, match="rope scaling 'linear' needs factor"):
        load_model(model_dir)
    _edit_config(model_dir, rope_scaling=None, hidden_act="gelu")
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        load_model(model_dir)
    _edit_config(model_dir, hidden_act="silu")
    assert load_model(model_dir, progress=False).config.architecture == "LlamaForCausalLM"
    (model_dir / "config.json").write_text('{\n  "vocab_size": 3,\n}')
    with pytest.raises(ValueError, match="config.json: invalid JSON at line 3"):
        load_model(model_dir)


# --- configs -----------------------------------------------------------------------------------

BASE = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2}


def test_config_sliding_windows():
    mistral = ModelConfig.from_dict({**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 32})
    assert [mistral.layer_sliding_window(i) for i in range(4)] == [32] * 4
    off = ModelConfig.from_dict({**BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 32,
                                 "use_sliding_window": False})
    assert off.sliding_window is None and off.layer_sliding_window(3) is None
    on = ModelConfig.from_dict({**BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 32,
                                "use_sliding_window": True, "max_window_layers": 2})
    assert [on.layer_sliding_window(i) for i in range(4)] == [None, None, 32, 32]
    explicit = ModelConfig.from_dict({**BASE, "model_type": "qwen3", "sliding_window": 8,
                                      "use_sliding_window": True,
                                      "layer_types": ["sliding_attention", "full_attention"] * 2})
    assert [explicit.layer_sliding_window(i) for i in range(4)] == [8, None, 8, None]
    with pytest.raises(ValueError, match="layer_types has 1 entries for 4 layers"):
        ModelConfig.from_dict({**BASE, "model_type": "llama", "layer_types": ["full_attention"]})


def test_config_fields_and_defaults():
    qwen2 = ModelConfig.from_dict({**BASE, "model_type": "qwen2", "eos_token_id": 5,
                                   "torch_dtype": "bfloat16"}, {"eos_token_id": [7, 5]})
    assert qwen2.architecture == "Qwen2ForCausalLM" and qwen2.head_dim == 16
    assert qwen2.qkv_bias and qwen2.attention_bias and not qwen2.o_bias and not qwen2.qk_norm
    assert qwen2.eos_token_ids == [7, 5] and qwen2.torch_dtype == "bfloat16"
    qwen3 = ModelConfig.from_dict({**BASE, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32,
                                   "attention_bias": True, "dtype": "float16"})
    assert qwen3.qk_norm and qwen3.head_dim == 32 and qwen3.qkv_bias and qwen3.o_bias
    assert qwen3.torch_dtype == "float16" and qwen3.num_key_value_heads == 2
    llama = ModelConfig.from_dict({k: v for k, v in BASE.items() if k != "num_key_value_heads"}
                                  | {"model_type": "llama"})
    assert llama.num_key_value_heads == 4 and llama.rope_theta == 10000.0 and llama.rope_scaling is None
    with pytest.raises(ValueError, match="required field 'hidden_size' is missing"):
        ModelConfig.from_dict({"model_type": "llama", "vocab_size": 3})


def test_config_reads_transformers_5_format(tmp_path):
    """transformers 5 writes rope_parameters (with rope_theta inside) and dtype."""
    scaling = {**LLAMA3_SCALING, "original_max_position_embeddings": 512}
    config = transformers.LlamaConfig(**BASE, rope_theta=500000.0, max_position_embeddings=1024,
                                      rope_scaling=dict(scaling))  # it adds rope_theta to the dict
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(tmp_path)
    ours = ModelConfig.from_dir(tmp_path)
    assert ours.rope_theta == 500000.0
    assert ours.rope_scaling == scaling
    assert ours.max_position_embeddings == 1024
