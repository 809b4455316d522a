"""Shared by the GGUF tests (test_gguf_load.py, test_gguf_archs.py): a GGUF folder written from an
HF checkpoint, the exact-equality check of a GGUF load against the HF-folder load, and the greedy
tokens + final logits check against transformers' own GGUF loading.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from gguf_writer import write_gguf

from batchinfer import LLM, SamplingParams
from batchinfer.workers.models import ModelConfig, load_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def gguf_folder(hf: Path, folder: Path, qtype) -> Path:
    """``folder`` holding ``m.gguf`` written from checkpoint ``hf`` in ``qtype``, and its tokenizer files."""
    folder.mkdir()
    write_gguf(hf, folder / "m.gguf", qtype)
    for name in TOKENIZER_FILES:
        shutil.copy(hf / name, folder / name)
    return folder


def prompts() -> list[list[int]]:
    """Token-id prompts of 1 to 70 tokens (past the tiny models' sliding windows and chunk budgets)."""
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (1, 5, 17, 40, 70)]


def hf_greedy(hf, prompt: list[int], max_new: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy tokens for ``prompt`` and the logits of each generated step."""
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                      eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), [s[0].float() for s in out.logits]


def assert_same_model(gguf_path: Path, hf_dir: Path, atol: float = 0.0,
                      skip: frozenset[str] = frozenset({"torch_dtype", "eos_token_ids"})) -> ModelConfig:
    """Our load of ``gguf_path`` equals our load of ``hf_dir``: every parameter and config field."""
    ours, ref = load_model(gguf_path, progress=False), load_model(hf_dir, progress=False)
    a, b = ours.state_dict(), ref.state_dict()
    assert a.keys() == b.keys()
    for name in b:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=atol, msg=name)
    for field in ModelConfig.__dataclass_fields__:
        if field not in skip:
            assert getattr(ours.config, field) == getattr(ref.config, field), field
    return ours.config


def assert_matches_transformers(folder: Path, prompt_ids: list[list[int]], max_new: int = 8,
                                budget: int = 32, atol: float = 1e-4) -> None:
    """Our greedy tokens and final-step logprobs (``LLM`` over ``folder``, chunked prefill at
    ``budget`` tokens) equal transformers' ``from_pretrained(folder, gguf_file="m.gguf")``."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file="m.gguf",
                                                           dtype=torch.float32).eval()
    llm = LLM(folder, max_num_batched_tokens=budget)
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
    for prompt, out in zip(prompt_ids, outs, strict=True):
        with torch.no_grad():
            tokens, logits = hf_greedy(hf, prompt, max_new)
        completion = out.outputs[0]
        assert completion.token_ids == tokens, f"{len(prompt)}-token prompt diverges"
        ref = torch.log_softmax(logits[-1], dim=-1)  # the final step's logits, up to a shift
        for token, lp in completion.logprobs[-1].items():
            assert abs(lp.logprob - ref[token].item()) < atol
