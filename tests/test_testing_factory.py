"""make_tiny_model: deterministic, complete, loadable checkpoints whose greedy output varies."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from batchinfer.workers.models import load_model
from batchinfer.workers.models.attention import AttentionMetadata
from batchinfer.workers.models.tiny import make_tiny_demo_model, make_tiny_model, tokenizer_files
from batchinfer.workers.text.tokenizer import Tokenizer

FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
         "tokenizer_config.json"]


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    a = make_tiny_model(tmp_path / "a", "Qwen3ForCausalLM", seed=7)
    b = make_tiny_model(tmp_path / "b", "Qwen3ForCausalLM", seed=7)
    c = make_tiny_model(tmp_path / "c", "Qwen3ForCausalLM", seed=8)
    for name in FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


def test_sharded_layout_and_rewrite(tmp_path):
    path = make_tiny_model(tmp_path / "m", shards=3)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    tensors = {n: t for f in files for n, t in load_file(path / f).items()}
    assert sorted(index["weight_map"]) == sorted(tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    # Writing a single-file checkpoint into the same directory removes the shards and index.
    make_tiny_model(path)
    assert sorted(p.name for p in path.glob("model*")) == ["model.safetensors"]
    assert not list(path.glob("*.tmp"))


def test_overrides_reach_config_and_weights(tmp_path):
    path = make_tiny_model(tmp_path / "m", "MistralForCausalLM", num_hidden_layers=3, hidden_size=32,
                           sliding_window=8, vocab_size=384, torch_dtype="bfloat16")
    config = json.loads((path / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["sliding_window"]) == (3, 32, 8)
    model = load_model(path, dtype="auto", progress=False)
    assert model.dtype == torch.bfloat16 and model.config.vocab_size == 384
    assert model.num_layers == 3 and model.config.sliding_window == 8


def test_special_tokens_and_eos_agree(tiny_llama):
    tok = Tokenizer.from_dir(tiny_llama)
    model = load_model(tiny_llama, progress=False)
    assert model.config.eos_token_ids == tok.eos_token_ids
    assert model.config.bos_token_id == tok.bos_token_id
    assert tok.vocab_size == model.config.vocab_size
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]).endswith("<|assistant|>\n")
    files = tokenizer_files()
    for name, data in files.items():
        assert (tiny_llama / name).read_bytes() == data, name
    assert Tokenizer.from_files(*files.values()).encode("héllo") == tok.encode("héllo")


@pytest.mark.parametrize("architecture",
                         ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_greedy_output_is_not_degenerate(tmp_path, architecture):
    """Random weights must still give varied greedy continuations, or engine tests prove little."""
    model = load_model(make_tiny_model(tmp_path / "m", architecture), progress=False)
    for prompt in ([312, 50, 60, 70], [312, 100, 30]):
        tokens = greedy(model, prompt, 24)
        assert len(set(tokens)) >= 6, tokens
        assert tokens[0] != prompt[-1]


def greedy(model, prompt: list[int], steps: int) -> list[int]:
    """Greedy decoding of one sequence in one contiguous run of cache blocks."""
    block_size, total = 16, len(prompt) + steps
    blocks = -(-total // block_size)
    shape = (blocks, block_size, model.num_kv_heads, model.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(model.num_layers)]
    table = torch.arange(blocks, dtype=torch.int32)[None]
    out, new, start = [], prompt, 0
    for _ in range(steps):
        end = start + len(new)
        meta = AttentionMetadata(
            slot_mapping=torch.arange(start, end), block_tables=table,
            cu_seqlens_q=torch.tensor([0, len(new)], dtype=torch.int32),
            seq_lens=torch.tensor([end], dtype=torch.int32), max_seqlen_q=len(new), max_seqlen_k=end,
            backend="reference")
        with torch.no_grad():
            hidden = model(torch.tensor(new), torch.arange(start, end), caches, meta)
            token = int(model.compute_logits(hidden[-1:]).argmax())
        out.append(token)
        new, start = [token], end
    return out


def test_tiny_demo_model(tmp_path):
    path = make_tiny_demo_model(tmp_path / "tiny")
    model = load_model(path, progress=False)
    assert (model.num_layers, model.config.hidden_size) == (4, 128)
    assert sum(p.numel() for p in model.parameters()) > 500_000


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="unknown architecture 'GPT2'; supported: LlamaForCausalLM"):
        make_tiny_model(tmp_path / "m", "GPT2")
    with pytest.raises(ValueError, match="vocab_size 100 is smaller than the tokenizer's 320"):
        make_tiny_model(tmp_path / "m", vocab_size=100)
    with pytest.raises(ValueError, match="shards must be >= 1"):
        make_tiny_model(tmp_path / "m", shards=0)
    with pytest.raises(ValueError, match="torch_dtype 'int8'"):
        make_tiny_model(tmp_path / "m", torch_dtype="int8")
