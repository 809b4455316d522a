"""Tool calling end to end (issue 29, section 1): chat lines with ``tools`` through the real scheduler
and worker daemons, the worker's rows of ``auto`` calls, and ``LLM.chat(tools=...)``.

A tiny random Llama whose chat template renders tools in the hermes format (written here, as Qwen 2.5's
does it) runs as a worker subprocess: ``tool_choice: "required"`` and a named function give rows whose
calls parse and whose arguments validate against their functions' ``parameters`` (only the
constraint makes a random model's output valid), with ``finish_reason: "tool_calls"``; the prompt the
worker got is the template's rendering with the tools (its token count is ours); a schema that does
not compile is an ``invalid_request`` row naming ``tools``. A random model writes no calls, so
``auto`` is checked on crafted outputs (``generation_row``) and through echo workers, whose
completion is the prompt: one started with ``--tool-call-parser hermes`` reads the call a user
message carries, one without a parser answers ``auto`` lines with an ``invalid_request`` row and
every other line as usual. The slow test runs the real SmolLM2 over the real-API schemas of
``tests/tool_schemas.py``.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from daemons import CLI, Stack, assert_exactly_once
from structured_cases import FORMAT_CHECKER
from tool_schemas import TOOLS as API_TOOLS

from batchinfer.protocol.rows import BatchRequest
from batchinfer.workers.engine.outputs import CompletionOutput, RequestOutput
from batchinfer.workers.sampling_params import SamplingParams
from batchinfer.workers.service.rows import generation_row
from batchinfer.workers.text.tokenizer import Tokenizer
from batchinfer.workers.tools import ToolParserMissing, ToolSpec, parse_tools, template_messages

pytestmark = pytest.mark.timeout(300)

# Hermes-style tools in the system turn, calls as <tool_call> JSON, tool results as <tool_response>
# (Qwen 2.5's layout, in the byte-level tiny tokenizer's plain text).
HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}\
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{% if message.content %}{{ message.content }}
{% endif %}
{%- for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

MODEL = "tiny-hermes"  # the hermes_model folder's name, which its worker serves


def _function(name: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": f"The {name} tool.",
        "parameters": {"type": "object", "properties": properties, "required": required,
                       "additionalProperties": False}}}


# Bounded languages (structured_cases.py says why): a random model leaves them within max_tokens.
TOOLS = [
    _function("get_weather", {"city": {"type": "string", "maxLength": 12},
                              "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ["city"]),
    _function("search", {"query": {"type": "string", "maxLength": 20},
                         "limit": {"type": "integer", "minimum": 1, "maximum": 10}}, ["query", "limit"]),
    _function("create_event", {
        "title": {"type": "string", "maxLength": 16},
        "when": {"type": "object", "properties": {"day": {"type": "integer", "minimum": 1, "maximum": 31},
                                                  "month": {"enum": ["jan", "feb", "mar"]}},
                 "required": ["day", "month"], "additionalProperties": False},
        "attendees": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}},
        ["title", "when"]),
]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HISTORY = [  # a finished call and its result, then a new question: renders with and without tools
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\", \"unit\": \"celsius\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": -3}"},
    {"role": "user", "content": "And in Rome?"},
]


def named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


def chat_line(cid: str, messages=ASK, **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "gpt-4o-mini", "messages": messages, "temperature": 0, "max_tokens": 300,
                     **body}}


def check_calls(calls: list[dict] | None, parameters: dict[str, dict], where: str) -> list[str]:
    """Each call in OpenAI's shape, its arguments valid for its function; returns the names."""
    assert calls, f"{where}: no tool calls"
    names = []
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_") and len(call["id"]) == 29, call
        name, args = call["function"]["name"], json.loads(call["function"]["arguments"])
        # closed: a forced call declares no key its function did not (call_constraint closes objects)
        validator = jsonschema.Draft202012Validator(closed(parameters[name]), format_checker=FORMAT_CHECKER)
        validator.validate(args)
        names.append(name)
    return names


def closed(schema):
    """``schema`` with every object schema that does not state ``additionalProperties`` closed."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    literal = ("const", "enum", "default", "examples")
    out = {k: v if k in literal else closed(v) for k, v in schema.items()}
    if (schema.get("type") == "object" or "properties" in schema) and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


def rendered_tokens(tokenizer: Tokenizer, messages: list[dict], tools: list[dict] | None) -> int:
    kwargs = {"tools": tools} if tools is not None else {}
    return len(tokenizer.apply_chat_template(template_messages(messages), add_generation_prompt=True,
                                             tokenize=True, **kwargs))


@pytest.fixture(scope="session")
def hermes_model(tmp_path_factory) -> Path:
    """The tiny random Llama with HERMES_TEMPLATE (chat_template.jinja wins over the config's) and room
    for prompts that hold the tools (byte-level: a token per byte)."""
    from batchinfer.workers.models.tiny import make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("models") / MODEL, max_position_embeddings=4096)
    (path / "chat_template.jinja").write_text(HERMES_TEMPLATE, encoding="utf-8")
    return path


@pytest.fixture
def stack(redis_server, tmp_path):
    s = Stack(redis_server.url, tmp_path)
    yield s
    s.close()


def run_job(stack: Stack, tmp_path: Path, lines: list[dict], model: str, name: str) -> dict[str, dict]:
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    job = stack.client.submit(path, model=model)
    record = stack.wait(job)
    assert record.status.value == "completed", (record, stack.logs())
    return {r["custom_id"]: r for r in assert_exactly_once(stack, job, len(lines), record)}


# -- the daemons, on the tiny model -----------------------------------------------------------------


def test_tool_lines_through_the_scheduler_and_a_worker(stack, hermes_model, tmp_path):
    stack.start("scheduler", "scheduler")
    stack.start("exporter", "exporter")
    stack.start("w1", "worker", "--name", "w1", "--device", "cpu", "--model", str(hermes_model),
                "--tool-call-parser", "hermes")
    stack.wait_for_worker("w1")
    bad_tool = _function("broken", {"x": {"type": "strng"}}, ["x"])
    bad_history = [*HISTORY[:2], {**HISTORY[2], "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{not json"}}]}]
    lines = [
        chat_line("required", tools=TOOLS, tool_choice="required"),
        chat_line("serial", tools=TOOLS, tool_choice="required", parallel_tool_calls=False),
        chat_line("sampled", tools=TOOLS, tool_choice="required", n=2, temperature=1.0, seed=3),
        chat_line("named", tools=TOOLS, tool_choice=named("create_event")),
        chat_line("history", HISTORY, tools=TOOLS, tool_choice=named("get_weather")),
        chat_line("none", tools=TOOLS, tool_choice="none", max_tokens=8),
        chat_line("auto", tools=TOOLS, max_tokens=8),
        chat_line("no_tools", HISTORY, max_tokens=8),
        chat_line("bad_schema", tools=[*TOOLS, bad_tool], tool_choice="required"),
        chat_line("bad_arguments", bad_history, tools=TOOLS),
    ]
    rows = run_job(stack, tmp_path, lines, MODEL, "tools")

    for cid in ("required", "serial", "sampled", "named", "history"):
        row = rows[cid]
        assert (row["status"], row["finish_reason"]) == ("completed", "tool_calls"), row
        assert row["tool_calls"] == row["outputs"][0]["tool_calls"]
        for out in row["outputs"]:
            names = check_calls(out["tool_calls"], PARAMETERS, cid)
            assert (out["text"], out["finish_reason"]) == ("", "tool_calls"), out
        assert row["output_text"] == ""
    assert len(rows["serial"]["tool_calls"]) == 1
    assert len(rows["sampled"]["outputs"]) == 2
    assert [c["function"]["name"] for c in rows["named"]["tool_calls"]] == ["create_event"]
    assert [c["function"]["name"] for c in rows["history"]["tool_calls"]] == ["get_weather"]
    ids = [c["id"] for r in rows.values() for out in r["outputs"] or [] for c in out["tool_calls"] or []]
    assert len(ids) == len(set(ids))  # ids are per request and completion
    assert names  # the last loop ran

    # the prompt the worker ran is the template's, with the tools (and the history's calls as objects)
    tokenizer = Tokenizer.from_dir(hermes_model)
    for cid, messages, tools in (("required", ASK, TOOLS), ("none", ASK, TOOLS), ("auto", ASK, TOOLS),
                                 ("history", HISTORY, TOOLS), ("no_tools", HISTORY, None)):
        assert rows[cid]["prompt_tokens"] == rendered_tokens(tokenizer, messages, tools), cid
    assert rows["none"]["prompt_tokens"] > rendered_tokens(tokenizer, ASK, None) + 300  # the tools' JSON
    as_strings = len(tokenizer.apply_chat_template(HISTORY, tools=TOOLS, tokenize=True))
    assert rows["history"]["prompt_tokens"] != as_strings  # arguments reached the template parsed

    # none, auto (a random model writes no <tool_call>) and no tools: text rows, no calls
    for cid in ("none", "auto", "no_tools"):
        row = rows[cid]
        assert row["status"] == "completed" and row["tool_calls"] is None, row
        assert row["outputs"][0]["tool_calls"] is None and row["finish_reason"] in ("stop", "length")
        assert row["output_text"] == row["outputs"][0]["text"] and row["output_token_ids"]

    # before dispatch: a schema the grammar backend refuses names `tools`; bad history arguments their path
    broken = rows["bad_schema"]
    assert (broken["status"], broken["error_code"], broken["worker"]) == ("failed", "invalid_request", None)
    assert broken["error_message"].startswith("tools:"), broken["error_message"]
    args = rows["bad_arguments"]
    assert (args["status"], args["error_code"], args["worker"]) == ("failed", "invalid_request", None)
    assert args["error_message"].startswith("messages[2].tool_calls[0].function.arguments:"), args


def test_auto_on_echo_workers_with_and_without_a_parser(stack, tmp_path):
    """The echo engine's completion is its prompt: a user message holding a hermes call makes the
    worker started with --tool-call-parser hermes read it; the byte tokenizer's template names no
    format, so the worker without the flag fails the ``auto`` lines (only those)."""
    stack.start("scheduler", "scheduler")
    stack.start("exporter", "exporter")
    for name, flags in (("hermes", ["--tool-call-parser", "hermes"]), ("plain", [])):
        stack.start(name, "worker", "--name", name, "--echo", "--served-model-name", f"echo-{name}", *flags)
    stack.wait_for_workers(2)
    call = '<tool_call>\n{"name": "search", "arguments": {"query": "tide tables", "limit": 2}}\n</tool_call>'
    carrying = [{"role": "user", "content": call}]
    lines = [chat_line("auto", carrying, tools=TOOLS, max_tokens=400),
             chat_line("none", carrying, tools=TOOLS, tool_choice="none", max_tokens=400),
             chat_line("plain", carrying, max_tokens=400)]

    read = run_job(stack, tmp_path, lines, "echo-hermes", "hermes")
    auto = read["auto"]
    assert (auto["status"], auto["finish_reason"], auto["worker"]) == ("completed", "tool_calls", "hermes")
    [found] = auto["tool_calls"]
    arguments = json.dumps({"query": "tide tables", "limit": 2})
    assert found["function"] == {"name": "search", "arguments": arguments}
    assert "<tool_call>" not in auto["output_text"] and auto["output_text"] == auto["outputs"][0]["text"]
    for cid in ("none", "plain"):  # the same text, left as it is
        assert read[cid]["tool_calls"] is None and call in read[cid]["output_text"], read[cid]
        assert read[cid]["finish_reason"] == "stop"

    unread = run_job(stack, tmp_path, lines, "echo-plain", "plain")
    failed = unread["auto"]
    assert (failed["status"], failed["error_code"], failed["worker"]) == \
        ("failed", "invalid_request", "plain")
    assert "--tool-call-parser" in failed["error_message"]
    assert failed["started_at"] is None  # refused before it ran: no generation spent on it
    assert [unread[cid]["status"] for cid in ("none", "plain")] == ["completed", "completed"]
    stack.check_alive()  # the failed request cost its row, not the worker


def test_an_unknown_tool_call_parser_is_refused_by_the_flag(tmp_path):
    done = subprocess.run([*CLI, "worker", "--echo", "--tool-call-parser", "qwen"], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2 and "--tool-call-parser" in done.stderr, done.stderr
    assert "hermes" in done.stderr  # the choices
    done = subprocess.run([*CLI, "run", "x.jsonl", "-o", "y.jsonl", "--echo", "--tool-call-parser", "qwen"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2 and "--tool-call-parser" in done.stderr, done.stderr


@pytest.mark.slow
def test_run_passes_the_tool_call_parser_to_its_workers(tmp_path):
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Lima"}}</tool_call>'
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps(chat_line("auto", [{"role": "user", "content": call}], tools=TOOLS)) + "\n")
    out = tmp_path / "out.jsonl"
    done = subprocess.run([*CLI, "run", str(path), "-o", str(out), "--echo", "--tool-call-parser", "hermes"],
                          capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    [row] = map(json.loads, out.read_text().splitlines())
    assert row["finish_reason"] == "tool_calls", row
    assert [c["function"]["name"] for c in row["tool_calls"]] == ["get_weather"]


# -- the worker's rows of auto calls, on crafted outputs --------------------------------------------


def request_with(tools: dict | None, n: int = 1) -> BatchRequest:
    return BatchRequest(request_id="job:4", job_id="job", idx=4, prompt_token_ids=[1, 2],
                        sampling_params=SamplingParams(n=n).to_dict(), model="m", custom_id="c", tools=tools)


def output_of(*texts: str, finish_reason: str = "stop") -> RequestOutput:
    return RequestOutput("e1", [1, 2], [CompletionOutput(i, text, [5] * (i + 1), finish_reason)
                                        for i, text in enumerate(texts)], finished=True)


def auto_spec(choice: Any = None) -> dict:
    spec = parse_tools(TOOLS, choice)
    assert spec is not None
    return spec.to_dict()


def test_generation_row_reads_auto_calls_with_the_workers_parser():
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "search", "arguments": {"query": "ski", "limit": 1}}\n'
            '</tool_call>')
    request = request_with(auto_spec(), n=2)
    row = generation_row(request, output_of(text, "no call here"), tool_parser="hermes")
    first, second = row.outputs or []
    assert (first["text"], first["finish_reason"]) == ("Let me look.", "tool_calls")
    assert check_calls(first["tool_calls"], PARAMETERS, "first") == ["get_weather", "search"]
    assert row.tool_calls == first["tool_calls"] and row.output_text == "Let me look."
    assert row.finish_reason == "tool_calls"
    assert (second["text"], second["tool_calls"], second["finish_reason"]) == ("no call here", None, "stop")
    # ids: per request, completion and position, the same when the row is made again (a retry)
    again = generation_row(request_with(auto_spec(), n=2), output_of(text, "x"), tool_parser="hermes")
    assert again.tool_calls == row.tool_calls
    assert len({c["id"] for c in row.tool_calls or []}) == 2
    # a call cut by max_tokens keeps its finish_reason; a malformed call or an unknown function is text
    cut = generation_row(request, output_of(text, finish_reason="length"), tool_parser="hermes")
    assert cut.finish_reason == "length" and cut.tool_calls is not None
    for bad in ('<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',
                '<tool_call>{"name": "launch", "arguments": {}}</tool_call>'):
        row = generation_row(request_with(auto_spec()), output_of(bad), tool_parser="hermes")
        assert (row.output_text, row.tool_calls, row.finish_reason) == (bad, None, "stop")


def test_generation_row_without_tools_or_with_none_leaves_the_text():
    text = '<tool_call>{"name": "search", "arguments": {"query": "a", "limit": 1}}</tool_call>'
    for tools in (None, auto_spec("none")):
        row = generation_row(request_with(tools), output_of(text), tool_parser="hermes")
        assert (row.output_text, row.tool_calls, row.finish_reason) == (text, None, "stop")
        assert row.outputs is not None and row.outputs[0]["tool_calls"] is None


def test_generation_row_of_auto_without_a_parser_raises_tool_parser_missing():
    with pytest.raises(ToolParserMissing, match="--tool-call-parser"):
        generation_row(request_with(auto_spec()), output_of("hi"), tool_parser=None)
    forced = auto_spec("required")  # required needs no parser: the output is the constrained JSON
    row = generation_row(request_with(forced), output_of('[{"name": "search", "parameters": '
                                                         '{"query": "q", "limit": 3}}]'), tool_parser=None)
    assert row.tool_calls is not None and row.finish_reason == "tool_calls" and row.output_text == ""


# -- LLM.chat ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hermes_llm(hermes_model):
    from batchinfer.workers.entrypoints.llm import LLM

    return LLM(hermes_model)


def test_llm_chat_with_required_named_and_none(hermes_llm):
    params = SamplingParams(max_tokens=300, temperature=0)
    outs = hermes_llm.chat([ASK, HISTORY], params, tools=TOOLS, tool_choice="required", use_tqdm=False)
    for out in outs:
        [done] = out.outputs
        check_calls(done.tool_calls, PARAMETERS, "required")
        assert (done.text, done.finish_reason) == ("", "tool_calls")
    [out] = hermes_llm.chat(ASK, params, tools=TOOLS, tool_choice=named("search"), parallel_tool_calls=False,
                            use_tqdm=False)
    assert check_calls(out.outputs[0].tool_calls, PARAMETERS, "named") == ["search"]
    # the spec's schema is the constraint: the same tokens as asking for it by hand
    spec = ToolSpec.from_dict(auto_spec(named("search")))
    [by_hand] = hermes_llm.chat(ASK, SamplingParams(max_tokens=300, temperature=0,
                                                    structured_outputs=spec.call_constraint()),
                                tools=TOOLS, use_tqdm=False)
    assert by_hand.outputs[0].token_ids == out.outputs[0].token_ids
    [free] = hermes_llm.chat(ASK, SamplingParams(max_tokens=8, temperature=0), tools=TOOLS,
                             tool_choice="none", use_tqdm=False)
    assert free.outputs[0].tool_calls is None and free.outputs[0].finish_reason in ("stop", "length")
    # the prompt holds the tools (the template got them), as the scheduler renders it
    tokenizer = hermes_llm.get_tokenizer()
    assert len(free.prompt_token_ids) == rendered_tokens(tokenizer, ASK, TOOLS)
    assert len(outs[1].prompt_token_ids) == rendered_tokens(tokenizer, HISTORY, TOOLS)


def test_llm_chat_auto_parser_and_refusals(hermes_llm, tiny_llama):
    from batchinfer.workers.entrypoints.llm import LLM

    params = SamplingParams(max_tokens=8, temperature=0)
    # auto: the hermes template names its parser; a random model's text stays text
    [out] = hermes_llm.chat(ASK, params, tools=TOOLS, tool_choice="auto", use_tqdm=False)
    assert out.outputs[0].tool_calls is None and out.outputs[0].text
    with pytest.raises(ValueError, match="^sampling_params.structured_outputs:"):
        hermes_llm.chat(ASK, SamplingParams(structured_outputs={"regex": "a+"}), tools=TOOLS,
                        tool_choice="required")
    with pytest.raises(ValueError, match=r"^tool_choice: is only allowed when tools are given"):
        hermes_llm.chat(ASK, params, tool_choice="required")
    with pytest.raises(ValueError, match=r"^tool_choice.function.name: 'nope'"):
        hermes_llm.chat(ASK, params, tools=TOOLS, tool_choice=named("nope"))
    with pytest.raises(ValueError, match="^tool_call_parser: must be one of"):
        hermes_llm.chat(ASK, params, tools=TOOLS, tool_call_parser="qwen")
    # the tiny Llama's template names no format: auto asked for needs tool_call_parser ...
    plain = LLM(tiny_llama)
    with pytest.raises(ToolParserMissing, match="tool_call_parser=NAME"):
        plain.chat(ASK, params, tools=TOOLS, tool_choice="auto")
    # ... or is left as text when tool_choice is not given (vLLM's LLM.chat only renders tools)
    [kept] = plain.chat(ASK, params, tools=TOOLS, use_tqdm=False)
    assert kept.outputs[0].tool_calls is None and kept.outputs[0].finish_reason in ("stop", "length")
    [given] = plain.chat(ASK, params, tools=TOOLS, tool_choice="auto", tool_call_parser="hermes",
                         use_tqdm=False)
    assert given.outputs[0].token_ids == kept.outputs[0].token_ids and given.outputs[0].tool_calls is None


def test_auto_with_a_special_token_parser_keeps_special_tokens_in_the_text():
    """mistral's [TOOL_CALLS] / [ARGS] are special tokens: the text its parser reads must keep them."""
    from batchinfer.workers.entrypoints.llm import _with_call_schema
    from batchinfer.workers.tools import parse_tools

    auto = parse_tools(TOOLS, "auto", None)
    [kept] = _with_call_schema(None, auto, 1, "mistral")
    assert kept.skip_special_tokens is False and kept.structured_outputs is None
    [plain] = _with_call_schema([SamplingParams()], auto, 1, "hermes")
    assert plain.skip_special_tokens is True


# -- the real SmolLM2 over real-API schemas ---------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_smollm2_calls_validate_against_real_api_schemas():
    """Every call of SmolLM2-135M parses and validates against its function's ``parameters``: under
    ``required`` (one request per function's task, all in one batch) and under each function named.

    SmolLM2's template leaves the tools out of the prompt; the constraint alone makes the calls. A
    repetition penalty keeps greedy decoding from looping in an open array or object (it writes
    ``"sales","sales",...`` until max_tokens without one), as a caller of a small model would set."""
    from batchinfer import LLM
    from batchinfer.workers.models.demo import demo_gguf

    try:
        gguf = demo_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    llm = LLM(gguf, max_model_len=1024)
    parameters = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"}
                  for t in API_TOOLS}
    assert len(parameters) >= 20
    asks = [[{"role": "user", "content": f"Call {t['function']['name']}: "
              f"{t['function'].get('description', '')}"}] for t in API_TOOLS]
    params = SamplingParams(max_tokens=192, temperature=0, repetition_penalty=1.15)
    outs = llm.chat(asks, params, tools=API_TOOLS, tool_choice="required", parallel_tool_calls=False,
                    use_tqdm=False)
    chosen = []
    for ask, out in zip(asks, outs, strict=True):
        [done] = out.outputs
        chosen += check_calls(done.tool_calls, parameters, f"{ask[0]['content']} -> {done.text!r}")
        assert (done.text, done.finish_reason) == ("", "tool_calls")
    assert len(set(chosen)) > 1  # the model picks among the functions
    for name, ask in zip(parameters, asks, strict=True):
        [out] = llm.chat(ask, params, tools=API_TOOLS, tool_choice=named(name), use_tqdm=False)
        assert check_calls(out.outputs[0].tool_calls, parameters, name) == [name]
