"""``batchinfer convert FILE.gguf OUTDIR``: small GGUF files written with gguf's writer from tiny
random checkpoints, converted back to Hugging Face folders, then loaded by our ``LLM`` and by
transformers (greedy tokens compared). The real demo model's conversion is in test_real_model.py."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from gguf_writer import write_gguf  # noqa: E402

from batchinfer import LLM, SamplingParams  # noqa: E402
from batchinfer.cli import context as cli_context  # noqa: E402
from batchinfer.cli.convert import convert  # noqa: E402
from batchinfer.cli.main import cli  # noqa: E402
from batchinfer.workers.models import load_model  # noqa: E402
from batchinfer.workers.models.tiny import make_tiny_model  # noqa: E402

Q = gguf.GGMLQuantizationType
PROMPTS = ["Hello world! The quick brown fox", "The engine schedules requests", "There is the cache"]


def tiny_gguf(tmp_path, arch: str = "LlamaForCausalLM", qtype=Q.F32):
    hf = make_tiny_model(tmp_path / "hf", architecture=arch)
    return hf, write_gguf(hf, tmp_path / "tiny.gguf", qtype)


def greedy(llm: LLM, prompts: list[str] = PROMPTS, n: int = 12) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def hf_greedy(folder, prompt_ids: list[list[int]], n: int = 12) -> list[list[int]]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in prompt_ids:
            x = torch.tensor([ids])
            seq = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
            out.append(seq[0, len(ids):].tolist())
    return out


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
def test_f32_gguf_converts_back_to_the_original_checkpoint(tmp_path, arch):
    # Llama: q/k rows un-permuted, separate lm_head; Qwen2: biases, tied embeddings (no lm_head).
    hf, path = tiny_gguf(tmp_path, arch)
    out = convert(path, tmp_path / "out", dtype="float32")
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json"]
    original, converted = load_file(hf / "model.safetensors"), load_file(out / "model.safetensors")
    assert converted.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(converted[name], tensor), name
    config = json.loads((out / "config.json").read_text())
    source = json.loads((hf / "config.json").read_text())
    assert config["architectures"] == [arch] and config["torch_dtype"] == "float32"
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "vocab_size", "tie_word_embeddings", "rope_theta"):
        assert config[key] == source[key], key
    # the tokenizer came from the GGUF metadata: the folder's encodes as the GGUF file's own does
    # (the writer stores no chat template; the real model's is checked in test_real_model.py)
    text = "Hello world! The quick brown fox <|eot|> jumps"
    assert LLM(out).get_tokenizer().encode(text) == LLM(path).get_tokenizer().encode(text)


def test_converted_folder_gives_transformers_greedy_tokens(tmp_path):
    _, path = tiny_gguf(tmp_path, qtype=Q.Q8_0)
    out = convert(path, tmp_path / "out")  # auto: float16 (no BF16 tensors in the file)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float16"
    assert {t.dtype for t in load_file(out / "model.safetensors").values()} == {torch.float16}
    llm = LLM(out, dtype="float32")
    ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    ours = greedy(llm)
    assert ours == hf_greedy(out, ids)
    # the same weights as the GGUF itself gives, up to float16 rounding of the Q8_0 values
    direct, folder = load_model(path).state_dict(), load_model(out).state_dict()
    for name, tensor in direct.items():
        torch.testing.assert_close(folder[name], tensor, rtol=1e-3, atol=1e-3)


def test_shards_and_index_when_the_weights_exceed_the_shard_size(tmp_path):
    _, path = tiny_gguf(tmp_path)
    out = convert(path, tmp_path / "out", dtype="float32", shard_bytes=200_000)
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    assert greedy(LLM(out)) == greedy(LLM(path))
    # --force over a sharded folder with one file: the old shards and index go
    convert(path, out, dtype="float32", force=True)
    assert sorted(p.name for p in out.glob("model*")) == ["model.safetensors"]
    assert greedy(LLM(out)) == greedy(LLM(path))


def test_cli_refuses_a_non_empty_outdir_without_force(tmp_path):
    _, path = tiny_gguf(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    runner = CliRunner()
    result = runner.invoke(cli, ["convert", str(path), str(out)])
    assert result.exit_code == cli_context.EXIT_USAGE
    assert "is not empty; give --force" in result.output and not (out / "config.json").exists()
    result = runner.invoke(cli, ["convert", str(path), str(out), "--force", "--dtype", "bfloat16", "--json"])
    assert result.exit_code == 0, result.output
    files = json.loads(result.stdout.strip().splitlines()[-1])["files"]
    assert "model.safetensors" in files and "notes.txt" in files  # other files are left alone
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_cli_names_what_is_wrong_with_the_source(tmp_path):
    runner = CliRunner()
    not_gguf = tmp_path / "model.bin"
    not_gguf.write_bytes(b"\0" * 64)
    result = runner.invoke(cli, ["convert", str(not_gguf), str(tmp_path / "out")])
    assert result.exit_code == cli_context.EXIT_USAGE and "not a .gguf file" in result.output
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\xff" * 60)
    result = runner.invoke(cli, ["convert", str(broken), str(tmp_path / "out2")])
    assert result.exit_code == cli_context.EXIT_USAGE and "broken.gguf" in result.output
    assert not (tmp_path / "out2").exists()  # nothing written for a file that cannot be read


def test_doctor_checks_a_gguf_file(tmp_path):
    from batchinfer.cli.doctor import check_model_dir

    _, path = tiny_gguf(tmp_path, qtype=Q.Q8_0)
    checks = {c.name: c for c in check_model_dir(path)}
    template = checks.pop("model chat template")  # the writer stores none: a warning, not an error
    assert not template.ok and template.severity == "warning"
    assert all(c.ok for c in checks.values()), checks
    assert "LlamaForCausalLM" in checks["model config"].detail and "Q8_0" in checks["model weights"].detail
    assert "vocabulary of 320" in checks["model tokenizer"].detail
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\xff" * 60)
    [check] = check_model_dir(broken)
    assert not check.ok and "broken.gguf" in check.detail and check.fix
