"""GGUF checkpoints end to end: written with gguf's writer from tiny random HF checkpoints, loaded
by ``load_model`` / ``LLM``, and compared with the safetensors original and with transformers'
own GGUF loading (``from_pretrained(dir, gguf_file=...)``, which dequantizes with gguf's numpy).
"""

from __future__ import annotations

import shutil
import time

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

import gguf_helpers  # noqa: E402
from gguf_helpers import (  # noqa: E402
    TOKENIZER_FILES,
    assert_matches_transformers,
    assert_same_model,
    hf_greedy,
    prompts,
)

from batchinfer import LLM, SamplingParams  # noqa: E402
from batchinfer.workers.models import ModelConfig, load_model  # noqa: E402
from batchinfer.workers.models.gguf import GGUFFile, dequantize, gguf_path, unpermute_qk  # noqa: E402
from batchinfer.workers.models.tiny import make_tiny_model  # noqa: E402

Q = gguf.GGMLQuantizationType
ARCHITECTURES = ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
# transformers' GGUF config for qwen3 ignores attention.key_length (head_dim stays its default
# 128): give the tiny Qwen3 that head_dim so the reference builds the same model.
SHAPES = {"Qwen3ForCausalLM": {"hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1,
                               "head_dim": 128}}


def gguf_folder(tmp_path, arch: str, qtype) -> tuple:
    """(HF folder, GGUF folder holding m.gguf and the tiny tokenizer files)."""
    hf = make_tiny_model(tmp_path / arch, architecture=arch, **SHAPES.get(arch, {}))
    return hf, gguf_helpers.gguf_folder(hf, tmp_path / f"{arch}-{qtype.name}", qtype)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_f32_gguf_loads_the_checkpoint_exactly(tmp_path, arch):
    # Names, the undone q/k permutation (llama), biases (qwen2), q/k norms (qwen3), tied embeddings.
    hf, folder = gguf_folder(tmp_path, arch, Q.F32)
    config = assert_same_model(folder / "m.gguf", hf)  # every parameter bit-equal, every field
    assert config.eos_token_ids[0] == ModelConfig.from_dir(hf).eos_token_ids[0]
    # A folder holding one .gguf (and no safetensors) is the same checkpoint; so is from_dir.
    assert ModelConfig.from_dir(folder) == config


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1], ids=lambda t: t.name)
def test_quantized_tensors_match_gguf_numpy(tmp_path, qtype):
    _, folder = gguf_folder(tmp_path, "LlamaForCausalLM", qtype)
    f = GGUFFile(folder)
    assert {t.tensor_type for t in f.tensors.values()} == {qtype, Q.F32}  # norms stay F32
    model = load_model(folder)
    params = dict(model.named_parameters())
    heads, kv = model.config.num_attention_heads, model.config.num_key_value_heads
    q_rows = heads * model.config.head_dim
    for name, t in f.tensors.items():
        ref = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32))
        ref = ref.reshape(tuple(reversed(t.shape.tolist())))
        torch.testing.assert_close(dequantize(t), ref, rtol=0, atol=0)
        if name == "blk.0.attn_q.weight":  # lands, unpermuted, in the fused qkv rows
            qkv = params["layers.0.self_attn.qkv_proj.weight"]
            torch.testing.assert_close(qkv[:q_rows], unpermute_qk(ref, heads), rtol=0, atol=0)
        if name == "blk.0.attn_k.weight":
            qkv = params["layers.0.self_attn.qkv_proj.weight"]
            k = qkv[q_rows:q_rows + kv * model.config.head_dim]
            torch.testing.assert_close(k, unpermute_qk(ref, kv), rtol=0, atol=0)


@pytest.mark.parametrize("qtype", [Q.F16, Q.Q8_0, Q.Q4_1], ids=lambda t: t.name)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_and_logits_match_transformers_gguf(tmp_path, arch, qtype):
    _, folder = gguf_folder(tmp_path, arch, qtype)
    assert_matches_transformers(folder, prompts())  # chunked prefill (32) for the longer prompts


def test_served_name_of_a_gguf_file_is_its_stem(tmp_path):
    from batchinfer.workers.engine.engine import Engine
    from batchinfer.workers.engine_config import EngineConfig
    from batchinfer.workers.text.tokenizer import Tokenizer

    hf, folder = gguf_folder(tmp_path, "LlamaForCausalLM", Q.Q8_0)
    assert LLM(folder).engine.model_name == folder.name  # a folder: its name, as for HF folders
    engine = Engine(EngineConfig(model=str(folder / "m.gguf")), tokenizer=Tokenizer.from_dir(hf))
    assert engine.model_name == "m"  # a file: its stem (SmolLM2-135M-Instruct.Q4_1 for the demo)


def test_folder_with_several_ggufs_is_refused(tmp_path):
    _, folder = gguf_folder(tmp_path, "LlamaForCausalLM", Q.F32)
    shutil.copy(folder / "m.gguf", folder / "n.gguf")
    with pytest.raises(ValueError, match=r"holds 2 \.gguf files \(m\.gguf, n\.gguf\); give the file"):
        load_model(folder)
    assert gguf_path(folder / "n.gguf") == folder / "n.gguf"


def test_missing_gguf_file_and_folder_without_one(tmp_path):
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        load_model(tmp_path / "nope.gguf")
    with pytest.raises(FileNotFoundError, match=r"no \.gguf file in this folder"):
        GGUFFile(tmp_path)


def _write(path, arch="llama", qtype=Q.F32, tensor_bytes=None, keys=None, tensors=None):
    """A one-layer file: 32 wide, 2 heads (head_dim 16), 8 tokens; ``keys`` (suffix -> uint32 value)
    and ``tensors`` (name -> F32 array) added."""
    w = gguf.GGUFWriter(str(path), arch)
    for suffix, value in (keys or {}).items():
        w.add_uint32(f"{arch}.{suffix}", value)
    for name, array in (tensors or {}).items():
        w.add_tensor(name, array)
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_context_length(64)
    w.add_token_list([f"t{i}" for i in range(8)])
    if tensor_bytes is None:
        w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    else:
        w.add_tensor("token_embd.weight", tensor_bytes, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_architecture_lists_the_supported(tmp_path):
    path = _write(tmp_path / "x.gguf", arch="bert")
    with pytest.raises(ValueError, match=r"GGUF architecture 'bert' is not supported; supported: llama, "
                                         r"mistral, qwen2, qwen3, gemma2, gemma3, phi3, qwen2moe, qwen3moe"):
        load_model(path)


def test_partial_rotary_outside_phi3_is_refused(tmp_path):
    path = _write(tmp_path / "x.gguf", keys={"rope.dimension_count": 8})
    with pytest.raises(ValueError, match=r"rope.dimension_count 8 != head_dim 16 \(partial rotary\) is not "
                                         r"supported for llama files"):
        ModelConfig.from_dir(path)


def test_moe_files_missing_their_expert_tensors_are_refused(tmp_path):
    router = {"blk.0.ffn_gate_inp.weight": np.zeros((4, 32), np.float32)}
    path = _write(tmp_path / "a.gguf", "qwen2moe", keys={"expert_count": 4, "expert_used_count": 2})
    with pytest.raises(ValueError, match=r"a Qwen2MoeForCausalLM file needs qwen2moe.expert_count > 0 and "
                                         r"router tensors blk.N.ffn_gate_inp"):
        ModelConfig.from_dir(path)
    path = _write(tmp_path / "b.gguf", "qwen2moe", keys={"expert_count": 4, "expert_used_count": 2,
                                                         "expert_feed_forward_length": 16}, tensors=router)
    with pytest.raises(ValueError, match=r"a qwen2moe file needs the shared expert \(ffn_\*_shexp tensors\)"):
        ModelConfig.from_dir(path)


def test_unsupported_tensor_type_names_type_and_tensor(tmp_path):
    block, size = gguf.GGML_QUANT_SIZES[Q.IQ4_NL]
    raw = np.zeros((8, 32 // block * size), np.uint8)
    path = _write(tmp_path / "x.gguf", qtype=Q.IQ4_NL, tensor_bytes=raw)
    with pytest.raises(ValueError, match=r"token_embd\.weight: GGUF tensor type IQ4_NL is not supported"):
        load_model(path)


def test_missing_tensors_are_named(tmp_path):
    path = _write(tmp_path / "x.gguf")
    with pytest.raises(ValueError, match="checkpoint lacks tensors for"):
        load_model(path)


@pytest.mark.slow
def test_smollm2_q4_1_matches_transformers(tmp_path):
    from batchinfer.workers.models.demo import demo_gguf

    try:
        path = demo_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    start = time.perf_counter()
    model = load_model(path, progress=False)
    seconds = time.perf_counter() - start
    print(f"SmolLM2-135M-Instruct Q4_1: load_model {seconds:.2f} s")
    assert model.config.architecture == "LlamaForCausalLM" and model.config.vocab_size == 49152
    assert model.config.num_hidden_layers == 30 and model.config.tie_word_embeddings
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    # The GGUF (linked) next to the tiny tokenizer: token ids in, token ids out.
    folder = tmp_path / "smollm2"
    folder.mkdir()
    (folder / path.name).symlink_to(path)
    hf_dir = make_tiny_model(tmp_path / "tiny")
    for name in TOKENIZER_FILES:
        shutil.copy(hf_dir / name, folder / name)
    llm = LLM(folder, max_model_len=256)
    prompt = [1, 504, 3458, 282, 4649, 314, 1345, 28, 2]  # token ids (no tokenizer needed)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    with torch.no_grad():
        tokens, _ = hf_greedy(hf, prompt, 12)
    assert out.token_ids == tokens
    assert seconds < 60

