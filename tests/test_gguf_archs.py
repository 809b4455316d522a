"""GGUF files of the non-llama families (Gemma 2 so far): written by ``write_gguf`` the way
llama.cpp's converter lays them out, then our greedy tokens and final logits compared with
transformers' own GGUF loading (``from_pretrained(dir, gguf_file=...)``).
"""

from __future__ import annotations

import shutil

import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from test_gemma import make_gemma  # noqa: E402
from test_gguf_load import _hf_greedy, _prompts  # noqa: E402

from batchinfer import LLM, SamplingParams  # noqa: E402
from batchinfer.workers.models import ModelConfig, load_model  # noqa: E402
from batchinfer.workers.models.gguf import GGUFFile  # noqa: E402
from batchinfer.workers.models.gguf.writer import write_gguf  # noqa: E402

pytestmark = pytest.mark.slow  # ~16 s on two cores (transformers' eager Gemma generate dominates)
Q = gguf.GGMLQuantizationType
# transformers' GGUF config reads neither soft-cap nor query_pre_attn_scalar (its defaults: 50, 30,
# 256), so the tiny Gemma 2 uses those values (head_dim 256 = llama.cpp's scale rule) to build the
# same model on both sides.
GEMMA2 = dict(head_dim=256, query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
              final_logit_softcapping=30.0)


def _gemma2_gguf(tmp_path, qtype):
    hf, _ = make_gemma(tmp_path / "hf", "gemma2", **GEMMA2)
    folder = tmp_path / f"gguf-{qtype.name}"
    folder.mkdir()
    write_gguf(hf, folder / "m.gguf", qtype)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(hf / name, folder / name)
    return hf, folder


def test_gemma2_f32_gguf_is_the_checkpoint(tmp_path):
    # Sandwich-norm names, the +1 llama.cpp adds to Gemma's norms undone, tied head, config fields.
    hf, folder = _gemma2_gguf(tmp_path, Q.F32)
    f = GGUFFile(folder)
    assert "blk.0.post_ffw_norm.weight" in f.tensors and "output.weight" not in f.tensors
    ours, ref = load_model(folder / "m.gguf"), load_model(hf)
    a, b = ours.state_dict(), ref.state_dict()
    assert a.keys() == b.keys()
    for name in b:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-6, msg=name)
    skip = {"torch_dtype", "eos_token_ids", "max_position_embeddings"}
    for field in ModelConfig.__dataclass_fields__:
        if field not in skip:
            assert getattr(ours.config, field) == getattr(ref.config, field), field
    assert ours.config.attn_logit_softcapping == 50.0 and ours.config.final_logit_softcapping == 30.0
    assert ours.config.layer_sliding_window(0) == 8 and ours.config.layer_sliding_window(1) is None


def test_gemma2_f16_gguf_matches_transformers_gguf(tmp_path):
    _, folder = _gemma2_gguf(tmp_path, Q.F16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file="m.gguf",
                                                           dtype=torch.float32).eval()
    llm = LLM(folder, max_num_batched_tokens=32)
    prompts, n = _prompts()[:4], 8  # up to 40 tokens: past the sliding window of 8
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            tokens, logits = _hf_greedy(hf, prompt, n)
        completion = out.outputs[0]
        assert completion.token_ids == tokens, f"{len(prompt)}-token prompt diverges"
        ref = torch.log_softmax(logits[-1], dim=-1)
        for token, lp in completion.logprobs[-1].items():
            assert abs(lp.logprob - ref[token].item()) < 1e-4
