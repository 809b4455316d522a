"""Structured outputs through the real daemons (issue 13): scheduler, exporter and a worker on the tiny
random Llama (whose unconstrained output is noise: only the constraint makes it valid) as subprocesses.

An OpenAI batch file with ``response_format`` lines (``json_schema`` strict, one line per schema of
``tests/structured_cases.py``, and ``json_object``), vLLM ``structured_outputs`` regex / choice /
grammar lines and ``guided_*`` lines goes in; every completed row's text validates against its
schema (``jsonschema``) or matches its regex / choice / grammar, and says so (``structured``,
``structured_complete``) in the stream, the Parquet file (the two columns), JSONL and the OpenAI
output (``message.content``). Bad schemas, a bad regex, an empty choice list, two forms at once and
specs over the scheduler's limits (set with its flags) are error rows with their line numbers; a spec
under the scheduler's limits but over the worker's (``--engine-option structured_limits=...``) is an
``invalid_request`` row from the worker. Greedy and seeded lines, n = 2 and logprobs lines: 100% valid.
A worker started with ``--no-jump-forward`` then gives the same greedy tokens for the same lines, in
many more engine steps (its /metrics) for a schema whose keys are forced.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import urllib.request
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from daemons import CLI, Stack, assert_exactly_once
from structured_cases import CHOICE_CASES, GRAMMAR_CASES, JSON_SCHEMAS, REGEX_CASES, check_output

from batchinfer.workers.structured_params import StructuredOutputsParams

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny-llama"  # the tiny_llama fixture's folder name, which the worker serves
MESSAGES = [{"role": "user", "content": "Give me the record as JSON."}]
DEEP = {"type": "integer"}
for _ in range(10):  # 10 levels of arrays: over the scheduler's --structured-max-depth 8
    DEEP = {"type": "array", "items": DEEP, "maxItems": 1}
# ~6 KB: under the scheduler's 64 KiB, over the worker's 4 KiB
BIG_ENUM = {"enum": [f"v{i:04d}" for i in range(700)]}
WORKER_LIMITS = json.dumps({"max_spec_bytes": 4096})


def chat(cid: str, **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "gpt-4o-mini", "messages": MESSAGES, "temperature": 0, "max_tokens": 300,
                     **body}}


def completion(cid: str, prompt: str, **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/completions",
            "body": {"model": "gpt-4o-mini", "prompt": prompt, "temperature": 0, "max_tokens": 120, **body}}


def strict(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def good_lines() -> tuple[list[dict], dict[str, StructuredOutputsParams]]:
    """The lines that must complete, and the constraint each one's output must pass (by custom_id)."""
    lines: list[dict] = []
    want: dict[str, StructuredOutputsParams] = {}
    for name, schema in JSON_SCHEMAS.items():
        lines.append(chat(f"json:{name}", response_format=strict(name, schema)))
        want[f"json:{name}"] = StructuredOutputsParams(json=schema, disable_additional_properties=True)
    for name, regex in REGEX_CASES.items():
        lines.append(completion(f"regex:{name}", f"A {name}: ", structured_outputs={"regex": regex}))
        want[f"regex:{name}"] = StructuredOutputsParams(regex=regex)
    for name, choice in CHOICE_CASES.items():
        lines.append(completion(f"choice:{name}", "Pick one: ", structured_outputs={"choice": choice}))
        want[f"choice:{name}"] = StructuredOutputsParams(choice=choice)
    for name, (grammar, _) in GRAMMAR_CASES.items():
        lines.append(completion(f"grammar:{name}", "Say it: ", structured_outputs={"grammar": grammar}))
        want[f"grammar:{name}"] = StructuredOutputsParams(grammar=grammar)
    lines.append(chat("guided_json", guided_json=JSON_SCHEMAS["extraction"]))
    want["guided_json"] = StructuredOutputsParams(json=JSON_SCHEMAS["extraction"])
    lines.append(completion("guided_regex", "Code: ", guided_regex=REGEX_CASES["hex_color"]))
    want["guided_regex"] = StructuredOutputsParams(regex=REGEX_CASES["hex_color"])
    lines.append(chat("guided_choice", guided_choice=CHOICE_CASES["sentiment"]))
    want["guided_choice"] = StructuredOutputsParams(choice=CHOICE_CASES["sentiment"])
    return lines, want


def sampled_lines() -> tuple[list[dict], dict[str, StructuredOutputsParams]]:
    """Seeded sampling lines (every schema again), one with n = 2 and one asking for logprobs (which
    takes no jumps): their outputs must pass too, every completion of them."""
    lines: list[dict] = []
    want: dict[str, StructuredOutputsParams] = {}
    for i, (name, schema) in enumerate(JSON_SCHEMAS.items()):
        lines.append(chat(f"seeded:{name}", response_format=strict(name, schema), temperature=1.0, seed=i))
        want[f"seeded:{name}"] = StructuredOutputsParams(json=schema, disable_additional_properties=True)
    for cid, schema, extra in (
            ("n2", JSON_SCHEMAS["any_of"], {"n": 2, "temperature": 1.0, "seed": 7}),
            ("logprobs", JSON_SCHEMAS["const_fields"], {"logprobs": True, "top_logprobs": 2})):
        lines.append(chat(cid, response_format=strict("p", schema), **extra))
        want[cid] = StructuredOutputsParams(json=schema, disable_additional_properties=True)
    return lines, want


# custom_id -> (the line, the field its error row names, words of its message)
BAD_LINES: dict[str, tuple[dict, str, list[str]]] = {
    "bad_type": (chat("bad_type", response_format=strict("t", {"type": "objekt"})),
                 "response_format.json_schema.schema", ["objekt"]),
    "bad_ref": (chat("bad_ref", response_format=strict("r", {"$ref": "#/$defs/nowhere"})),
                "response_format.json_schema.schema", ["nowhere"]),
    "bad_regex": (completion("bad_regex", "x", structured_outputs={"regex": "[0-9"}),
                  "structured_outputs.regex", ["unclosed character class"]),
    "empty_choice": (completion("empty_choice", "x", guided_choice=[]), "guided_choice",
                     ["guided_choice must be a non-empty list"]),
    "two_forms": (chat("two_forms", response_format={"type": "json_object"}, guided_regex="a+"),
                  "guided_regex", ["response_format and guided_regex both constrain the output"]),
    "no_name": (chat("no_name", response_format={"type": "json_schema", "json_schema": {"schema": {}}}),
                "response_format.json_schema.name", ["name is missing"]),
    "too_deep": (chat("too_deep", response_format=strict("d", DEEP)), "response_format.json_schema.schema",
                 ["nests deeper than 8 levels", "BATCHINFER_STRUCTURED_MAX_DEPTH"]),
    "too_many_choices": (completion("too_many_choices", "x", guided_choice=[f"c{i}" for i in range(20)]),
                         "guided_choice",
                         ["20 choices; the limit is 16", "BATCHINFER_STRUCTURED_MAX_CHOICES"]),
}


@pytest.fixture
def stack(redis_server, tmp_path):
    s = Stack(redis_server.url, tmp_path)
    yield s
    s.close()


def start_worker(stack: Stack, name: str, model: Path, *flags: str) -> str:
    """Start worker ``name`` with the low spec-size limit and ``flags``; its /metrics URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    stack.start(name, "worker", "--name", name, "--device", "cpu", "--model", str(model),
                "--metrics-port", str(port), "--engine-option", f"structured_limits={WORKER_LIMITS}", *flags)
    stack.wait_for_worker(name)
    return f"http://127.0.0.1:{port}/metrics"


def engine_steps(metrics_url: str) -> int:
    """Engine steps the worker has taken (its step-duration histogram's count)."""
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    m = re.search(r"^batchinfer_step_duration_seconds_count\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    return int(float(m.group(1))) if m else 0


def run_job(stack: Stack, tmp_path: Path, lines: list[dict], name: str):
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    job = stack.client.submit(path, model=MODEL)
    record = stack.wait(job)
    assert record.status.value == "completed", (record, stack.logs())
    rows = assert_exactly_once(stack, job, len(lines), record)
    return job, record, {r["custom_id"]: r for r in rows}


def test_an_openai_batch_file_of_constrained_lines_through_the_daemons(stack, tiny_llama, tmp_path):
    stack.start("scheduler", "scheduler", "--structured-max-depth", "8", "--structured-max-choices", "16")
    stack.start("exporter", "exporter")
    w1 = start_worker(stack, "w1", tiny_llama, "--structured-outputs-backend", "llguidance")
    good, greedy = good_lines()
    sampled, want = sampled_lines()
    want.update(greedy)
    extra = [chat("json_object", response_format={"type": "json_object"}, max_tokens=40),
             chat("free", max_tokens=8),
             chat("text_format", response_format={"type": "text"}, max_tokens=8),
             chat("worker_limit", response_format=strict("e", BIG_ENUM))]
    bad = [line for line, _, _ in BAD_LINES.values()]
    lines = good + sampled + extra + bad
    job, record, rows = run_job(stack, tmp_path, lines, "structured")
    line_of = {line["custom_id"]: i + 1 for i, line in enumerate(lines)}

    # every constrained line completed, validates and says so: 100% valid, nothing retried or filtered
    for cid, params in want.items():
        row = rows[cid]
        assert row["status"] == "completed", row
        assert (row["finish_reason"], row["structured"], row["structured_complete"]) == \
            ("stop", params.kind, True), (cid, row["output_text"], row["finish_reason"])
        for out in row["outputs"]:
            check_output(params, out["text"])
            assert (out["finish_reason"], out["structured"], out["structured_complete"]) == \
                ("stop", params.kind, True), (cid, out)
    assert len(rows["n2"]["outputs"]) == 2
    assert len(rows["logprobs"]["outputs"][0]["logprobs"]) == len(rows["logprobs"]["output_token_ids"])
    # any JSON object: a random model rarely closes one within 40 tokens; a cut one says it is incomplete
    obj = rows["json_object"]
    assert obj["structured"] == "json_object"
    if obj["structured_complete"]:
        assert obj["finish_reason"] == "stop" and isinstance(json.loads(obj["output_text"]), dict)
    else:
        assert obj["finish_reason"] == "length" and obj["output_text"].startswith("{")
    for cid in ("free", "text_format"):  # unconstrained rows: both columns null
        assert rows[cid]["status"] == "completed"
        assert (rows[cid]["structured"], rows[cid]["structured_complete"]) == (None, None)

    # bad specs: error rows from the scheduler, with their line numbers, naming the field and the problem
    for cid, (_, field, words) in BAD_LINES.items():
        row = rows[cid]
        assert (row["status"], row["error_code"], row["line"]) == \
            ("failed", "invalid_request", line_of[cid]), row
        assert row["worker"] is None, row  # never dispatched
        assert field in row["error_message"], (field, row["error_message"])
        for word in words:
            assert word in row["error_message"], (word, row["error_message"])
    # under the scheduler's limits, over the worker's: the worker's engine refuses it, as an error row
    refused = rows["worker_limit"]
    assert (refused["status"], refused["error_code"], refused["line"], refused["worker"]) == \
        ("failed", "invalid_request", line_of["worker_limit"], "w1"), refused
    assert refused["error_message"].startswith("structured_outputs:") and "4096" in refused["error_message"]
    counts = stack.client.status(job)
    assert (counts.completed, counts.failed) == (len(good) + len(sampled) + 3, len(bad) + 1)

    # Parquet: the two columns, typed, as the stream says
    table = pq.read_table(record.output)
    assert table.schema.field("structured").type == pa.string()
    assert table.schema.field("structured_complete").type == pa.bool_()
    by_id = {r["custom_id"]: r for r in table.to_pylist()}
    for cid, row in rows.items():
        assert (by_id[cid]["structured"], by_id[cid]["structured_complete"]) == \
            (row["structured"], row["structured_complete"]), cid
    assert by_id["json:flat_person"]["outputs"][0]["structured_complete"] is True

    # --format openai: the JSON is the message's content, as OpenAI gives it; JSONL rows carry the fields
    out = tmp_path / "out.openai.jsonl"
    done = stack.cli("results", job, "-o", str(out), "--format", "openai")
    assert done.returncode == 0, done.stderr
    openai = {o["custom_id"]: o for o in map(json.loads, out.read_text().splitlines())}
    for name, schema in JSON_SCHEMAS.items():
        content = openai[f"json:{name}"]["response"]["body"]["choices"][0]["message"]["content"]
        check_output(StructuredOutputsParams(json=schema), content)
    assert openai["choice:sentiment"]["response"]["body"]["choices"][0]["text"] in CHOICE_CASES["sentiment"]
    assert openai["bad_regex"]["error"]["line"] == line_of["bad_regex"]
    out = tmp_path / "out.jsonl"
    done = stack.cli("results", job, "-o", str(out), "--format", "jsonl")
    assert done.returncode == 0, done.stderr
    jsonl = {o["custom_id"]: o for o in map(json.loads, out.read_text().splitlines())}
    phone = jsonl["regex:phone"]
    assert (phone["structured"], phone["structured_complete"]) == ("regex", True)
    assert (jsonl["free"]["structured"], jsonl["free"]["structured_complete"]) == (None, None)

    # --no-jump-forward: every forced token takes a step of its own, and greedy tokens are the same.
    # One request alone (no batching to vary) of a schema whose keys and punctuation are forced.
    solo = [chat("solo", response_format=strict("c", JSON_SCHEMAS["const_fields"]))]
    before = engine_steps(w1)
    _, _, jumped = run_job(stack, tmp_path, solo, "solo_jump")
    steps_jumping = engine_steps(w1) - before
    stack.stop("w1")
    w2 = start_worker(stack, "w2", tiny_llama, "--no-jump-forward")
    _, _, again = run_job(stack, tmp_path, good, "no_jump")
    for cid in greedy:
        assert again[cid]["worker"] == "w2"
        assert again[cid]["output_token_ids"] == rows[cid]["output_token_ids"], cid
    before = engine_steps(w2)
    _, _, stepped = run_job(stack, tmp_path, solo, "solo_steps")
    steps_stepping = engine_steps(w2) - before
    assert stepped["solo"]["output_token_ids"] == jumped["solo"]["output_token_ids"]
    # without jumps a step per token; with them the forced keys and punctuation cost none
    # ('{"version":2,"kind":"invoice","ok":' and the closing brace: all but true / false)
    tokens = len(jumped["solo"]["output_token_ids"])
    assert steps_stepping >= tokens and 0 < steps_jumping < steps_stepping // 4, \
        (steps_jumping, steps_stepping, tokens)


@pytest.mark.parametrize("flags", [["--no-jump-forward"], ["--structured-outputs-backend", "xgrammar"]])
def test_structured_worker_flags_need_an_engine(flags, tmp_path):
    done = subprocess.run([*CLI, "worker", "--echo", *flags], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "the echo engine has none" in done.stderr


def test_an_unknown_structured_outputs_backend_is_refused_by_the_flag(tmp_path):
    done = subprocess.run([*CLI, "worker", "--echo", "--structured-outputs-backend", "outlines"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "'outlines' is not one of 'llguidance', 'xgrammar'" in done.stderr
