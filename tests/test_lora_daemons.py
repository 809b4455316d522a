"""LoRA adapters through the real daemons (issue 15): a scheduler and two workers of the tiny random
Llama as subprocesses, serving different adapter sets.

Worker ``w-ab`` serves adapters ``a`` and ``b``, worker ``w-bc`` serves ``b`` and ``c``. One job's
lines name ``a`` (short name), ``tiny-llama:b`` (``BASE:NAME``), ``c``, the base model, and an
adapter nobody serves. Every completed row's tokens equal the in-process engine's for the same
adapter (so each row was answered by the right adapter), rows of ``a`` come from ``w-ab`` and
rows of ``c`` from ``w-bc`` (routing), and the unknown adapter is an ``unknown_model`` row that
lists the served adapters.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from daemons import Stack, assert_exactly_once
from lora_cases import make_peft_adapter

from batchinfer.workers.engine.engine import Engine
from batchinfer.workers.engine_config import EngineConfig
from batchinfer.workers.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(300)

BASE = "tiny-llama"  # the tiny_llama fixture's folder name, which the workers serve
PROMPTS = [[5, 17, 33, 60, 91, 120, 7, 8], [200, 13, 44, 9], [3, 3, 81, 64, 250, 11, 12, 19, 77, 30, 4]]
MAX_TOKENS = 12


@pytest.fixture
def stack(redis_server, tmp_path):
    s = Stack(redis_server.url, tmp_path)
    yield s
    s.close()


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: make_peft_adapter(tiny_llama, root / name, r=4 + 4 * i, alpha=16, seed=10 + i)
            for i, name in enumerate(("a", "b", "c"))}


def reference_tokens(tiny_llama: Path, adapters: dict[str, Path]) -> dict[tuple[str | None, int], list[int]]:
    """Greedy tokens of every (adapter or None, prompt index) from one in-process engine."""
    engine = Engine(EngineConfig(model=str(tiny_llama), num_kv_blocks=128,
                                 lora_modules={k: str(v) for k, v in adapters.items()}))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    keys = [(lora, i) for lora in (None, *adapters) for i in range(len(PROMPTS))]
    for n, (lora, i) in enumerate(keys):
        engine.add_request(str(n), prompt_token_ids=PROMPTS[i], sampling_params=params, lora=lora)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return {key: done[str(n)] for n, key in enumerate(keys)}


def line(cid: str, model: str, prompt: list[int]) -> dict:
    return {"custom_id": cid, "model": model, "prompt_token_ids": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True}


def test_a_job_over_three_adapters_and_the_base_on_two_workers(stack, tiny_llama, adapters, tmp_path):
    want = reference_tokens(tiny_llama, adapters)
    assert want[("a", 0)] != want[(None, 0)], "the adapter must change the greedy tokens"
    stack.start("scheduler", "scheduler")
    stack.start("exporter", "exporter")
    for name, served in (("w-ab", "ab"), ("w-bc", "bc")):
        flags = [f"--lora={x}={adapters[x]}" for x in served]
        stack.start(name, "worker", "--name", name, "--device", "cpu", "--model", str(tiny_llama),
                    "--engine-option", "num_kv_blocks=128", *flags)
    stack.wait_for_workers(2)
    names = {"a": "a", "b": f"{BASE}:b", "c": "c", None: BASE}
    lines, expected = [], {}
    for lora, model in names.items():
        for i, prompt in enumerate(PROMPTS):
            cid = f"{lora or 'base'}-{i}"
            lines.append(line(cid, model, prompt))
            expected[cid] = (lora, i)
    lines.append(line("unknown", f"{BASE}:zzz", PROMPTS[0]))
    path = tmp_path / "lines.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    job = stack.client.submit(path)
    record = stack.wait(job)
    assert record.status.value == "completed", (record, stack.logs())
    rows = {r["custom_id"]: r for r in assert_exactly_once(stack, job, len(lines), record)}
    bad = rows.pop("unknown")
    assert bad["status"] == "failed" and bad["error_code"] == "unknown_model", bad
    assert "'zzz'" in bad["error_message"] and "a, b, c" in bad["error_message"], bad["error_message"]
    for cid, (lora, i) in expected.items():
        row = rows[cid]
        assert row["status"] == "completed", (cid, row, stack.logs())
        assert list(row["output_token_ids"]) == want[(lora, i)], (cid, lora)
        if lora == "a":
            assert row["worker"] == "w-ab", (cid, row["worker"])
        if lora == "c":
            assert row["worker"] == "w-bc", (cid, row["worker"])
