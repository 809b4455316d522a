"""The ``auto`` tool-call parsers on crafted model outputs (one call, several, content before,
malformed, unknown names, nested and unicode arguments), ``extract_tool_calls`` for every choice,
the call ids, ``finish_reason_with_tools`` and ``parser_for_template`` on real template snippets."""

from __future__ import annotations

import json
import re

import pytest

from batchinfer.workers.tools import (
    NEEDS_SPECIAL_TOKENS,
    TOOL_PARSERS,
    ToolCallResult,
    ToolParserMissing,
    call_id,
    extract_tool_calls,
    finish_reason_with_tools,
    parse_tools,
    parser_for_template,
)

SPEC = parse_tools([{"type": "function", "function": {"name": n}}
                    for n in ("get_weather", "get_time", "search", "ping")])
NESTED = {"query": "hôtel à Zürich ☀",
          "filters": {"stars": [4, 5], "price": {"max": 250.5, "currency": "CHF"}, "pets": True,
                      "note": None}}


def calls(text: str, parser: str, spec=SPEC, seed="req-1:0") -> ToolCallResult:
    return extract_tool_calls(text, spec, parser, seed)


def pairs(result: ToolCallResult) -> list[tuple[str, dict]]:
    """The calls as (name, parsed arguments)."""
    assert result.tool_calls is not None
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in result.tool_calls]


def assert_text(result: ToolCallResult, text: str) -> None:
    assert result == ToolCallResult(text, None)


# -- hermes ---------------------------------------------------------------------------------------

def test_hermes_one_call():
    r = calls('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "hermes")
    assert r.content is None and pairs(r) == [("get_weather", {"city": "Paris"})]


def test_hermes_several_calls_and_content_before():
    text = ('Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
    r = calls(text, "hermes")
    assert r.content == "Let me check both."
    assert pairs(r) == [("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "CET"})]


def test_hermes_nested_unicode_arguments_serialised_as_json():
    r = calls(f"<tool_call>{json.dumps({'name': 'search', 'arguments': NESTED})}</tool_call>", "hermes")
    assert pairs(r) == [("search", NESTED)]
    assert "hôtel à Zürich ☀" in r.tool_calls[0]["function"]["arguments"]  # not \u-escaped


def test_hermes_unclosed_last_block_and_string_arguments():
    r = calls('<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}', "hermes")
    assert pairs(r) == [("get_time", {"zone": "UTC"})]
    r = calls('<tool_call>{"name": "ping"}</tool_call>', "hermes")  # no arguments: an empty object
    assert pairs(r) == [("ping", {})]


@pytest.mark.parametrize("text", [
    "The weather is fine.",  # no call: plain content
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}</tool_call>',  # a brace short
    "<tool_call>{'name': 'get_weather', 'arguments': {}}</tool_call>",  # Python, not JSON
    '<tool_call>{"arguments": {"city": "Paris"}}</tool_call>',  # no name
    '<tool_call>{"name": "get_weather", "arguments": ["Paris"]}</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": {"t": NaN}}</tool_call>',  # not JSON for clients
    'Sure <tool_call>{"name": "delete_everything", "arguments": {}}</tool_call>',  # not a listed function
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call><tool_call>{"name": "rm", "arguments": {}}',
    '<tool_call>{"name": "get_time", "arguments": {}}<tool_call>{"name": "ping"}</tool_call>',
])
def test_hermes_text_when_no_or_bad_call(text):
    assert_text(calls(text, "hermes"), text)


# -- llama3_json ----------------------------------------------------------------------------------

def test_llama3_json_one_call_with_parameters_or_arguments():
    assert pairs(calls('{"name": "get_weather", "parameters": {"city": "Rome"}}', "llama3_json")) == [
        ("get_weather", {"city": "Rome"})]
    r = calls('<|python_tag|>{"name": "get_time", "arguments": {"zone": "UTC"}}', "llama3_json")
    assert r.content is None and pairs(r) == [("get_time", {"zone": "UTC"})]


def test_llama3_json_several_calls_nested_unicode():
    search = json.dumps({"name": "search", "parameters": NESTED})
    text = f'{{"name": "get_time", "parameters": {{}}}}; {search} ;{{"name": "ping", "parameters": {{}}}}'
    assert pairs(calls(text, "llama3_json")) == [("get_time", {}), ("search", NESTED), ("ping", {})]


@pytest.mark.parametrize("text", [
    "It is sunny in Rome.",
    'The call would be {"name": "get_time", "parameters": {}}',  # prose first: not a call
    '{"name": "get_weather", "parameters": {"city": "Rome"}',  # cut short
    '{"name": "get_time", "parameters": {}} {"name": "ping", "parameters": {}}',  # no ';'
    '{"city": "Rome", "temperature": 21}',  # JSON, but not a call
    '{"name": "launch_rocket", "parameters": {}}',
    '{"name": "get_time", "parameters": {}};',  # a ';' and no call after it
])
def test_llama3_json_text_when_no_or_bad_call(text):
    assert_text(calls(text, "llama3_json"), text)


# -- mistral --------------------------------------------------------------------------------------

def test_mistral_list_form():
    text = ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Lyon"}}, '
            '{"name": "get_time", "arguments": {"zone": "CET"}}]')
    r = calls(text, "mistral")
    assert r.content is None
    assert pairs(r) == [("get_weather", {"city": "Lyon"}), ("get_time", {"zone": "CET"})]


def test_mistral_content_before_and_nested_unicode():
    listed = json.dumps([{"name": "search", "arguments": NESTED}], ensure_ascii=False)
    text = f"Je regarde.[TOOL_CALLS]{listed}"
    r = calls(text, "mistral")
    assert r.content == "Je regarde." and pairs(r) == [("search", NESTED)]


def test_mistral_args_form():
    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Nice"}[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{}'
    assert pairs(calls(text, "mistral")) == [("get_weather", {"city": "Nice"}), ("get_time", {})]


def test_mistral_bare_list_when_the_token_was_dropped():
    assert pairs(calls('[{"name": "ping", "arguments": {}}]', "mistral")) == [("ping", {})]


def test_mistral_args_form_needs_its_special_tokens():
    """Decoded with special tokens skipped, [TOOL_CALLS] and [ARGS] vanish and the calls are lost."""
    assert set(NEEDS_SPECIAL_TOKENS) == {"mistral"}
    stripped = 'get_weather{"city": "Nice"}get_time{}'
    assert_text(calls(stripped, "mistral"), stripped)


@pytest.mark.parametrize("text", [
    "Il fait beau.",
    "[1, 2, 3]",
    '[{"name": "Ada", "age": 36}]',  # a JSON list, but not of calls
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Lyon"}]',
    '[TOOL_CALLS] [{"name": "format_disk", "arguments": {}}]',
    '[TOOL_CALLS]get_weather[ARGS]{"city": ',
    "[TOOL_CALLS]",
])
def test_mistral_text_when_no_or_bad_call(text):
    assert_text(calls(text, "mistral"), text)


# -- pythonic -------------------------------------------------------------------------------------

def test_pythonic_one_and_several_calls():
    assert pairs(calls('[get_weather(city="Paris", unit="c")]', "pythonic")) == [
        ("get_weather", {"city": "Paris", "unit": "c"})]
    r = calls("<|python_start|>[get_time(zone='UTC'), ping()]<|python_end|>", "pythonic")
    assert r.content is None and pairs(r) == [("get_time", {"zone": "UTC"}), ("ping", {})]


def test_pythonic_literals_nested_unicode():
    text = ('[search(query="hôtel à Zürich ☀", filters={"stars": [4, 5], "price": {"max": 250.5, '
            '"currency": "CHF"}, "pets": True, "note": None}), get_time(zone="UTC", offset=-2, dst=false)]')
    assert pairs(calls(text, "pythonic")) == [("search", NESTED),
                                              ("get_time", {"zone": "UTC", "offset": -2, "dst": False})]


@pytest.mark.parametrize("text", [
    "The answer is 42.",
    "[1, 2, 3]",  # a list, not calls
    "[get_weather(city='Paris']",  # unbalanced
    "[get_weather('Paris')]",  # positional
    "[get_weather(city=__import__('os').system('true'))]",  # never evaluated
    "[get_weather(city=CITY)]",  # a variable
    "[get_weather(city='Par' + 'is')]",  # an expression
    "[get_weather(**{'city': 'Paris'})]",
    "[get_weather(city='Paris'), 3]",
    "[os.system(cmd='ls')]",  # an attribute, not a function name
    "[shutdown(now=True)]",  # not a listed function
    "[get_time(zone={1: 'a'})]",  # a key JSON cannot have
    "[get_time(zone=1e999)]",
])
def test_pythonic_text_when_no_or_bad_call(text):
    assert_text(calls(text, "pythonic"), text)


# -- extract_tool_calls: choices, ids, finish reason ----------------------------------------------

HERMES_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def test_no_spec_or_none_choice_is_text():
    assert_text(extract_tool_calls(HERMES_CALL, None, "hermes", "r"), HERMES_CALL)
    none = parse_tools(SPEC.tools, "none")
    assert_text(extract_tool_calls(HERMES_CALL, none, "hermes", "r"), HERMES_CALL)
    assert_text(extract_tool_calls(HERMES_CALL, none, None, "r"), HERMES_CALL)  # no parser needed


def test_auto_without_parser_tells_how_to_get_one():
    with pytest.raises(ToolParserMissing, match="--tool-call-parser NAME") as e:
        extract_tool_calls("hi", SPEC, None, "r")
    assert isinstance(e.value, ValueError)
    with pytest.raises(ValueError, match="unknown tool-call parser 'qwen'"):
        extract_tool_calls("hi", SPEC, "qwen", "r")


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_constrained_output_is_read_as_the_call_list(choice):
    spec = parse_tools(SPEC.tools, choice)
    text = '[{"name":"get_weather","parameters":{"city":"Paris","when":{"day":"lundi"}}}]'
    r = extract_tool_calls(text, spec, None, "r")  # no parser: the schema fixed the format
    assert r.content is None and pairs(r) == [("get_weather", {"city": "Paris", "when": {"day": "lundi"}})]
    assert r.tool_calls[0]["function"]["arguments"] == '{"city": "Paris", "when": {"day": "lundi"}}'


@pytest.mark.parametrize("text", ['[{"name":"get_weather","parameters":{"city":"Pa',  # max_tokens
                                  "[]", '{"name":"get_weather","parameters":{}}',
                                  '[{"name":"nope","parameters":{}}]', '[{"name":"ping"}]'])
def test_constrained_output_cut_short_is_text(text):
    assert_text(extract_tool_calls(text, parse_tools(SPEC.tools, "required"), None, "r"), text)


def test_call_ids_are_deterministic_and_distinct():
    ids = [c["id"] for c in calls(HERMES_CALL + HERMES_CALL, "hermes", seed="batch_req_1:0").tool_calls]
    again = [c["id"] for c in calls(HERMES_CALL + HERMES_CALL, "hermes", seed="batch_req_1:0").tool_calls]
    other = [c["id"] for c in calls(HERMES_CALL + HERMES_CALL, "hermes", seed="batch_req_1:1").tool_calls]
    assert ids == again and ids[0] != ids[1] and not set(ids) & set(other)
    assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", i) for i in ids + other)
    assert ids == [call_id("batch_req_1:0", 0), call_id("batch_req_1:0", 1)]
    assert len({call_id(str(s), i) for s in range(200) for i in range(5)}) == 1000


def test_call_shape_is_openai():
    (call,) = calls(HERMES_CALL, "hermes").tool_calls
    assert set(call) == {"id", "type", "function"} and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_finish_reason_with_tools():
    made = calls(HERMES_CALL, "hermes").tool_calls
    assert finish_reason_with_tools("stop", made) == "tool_calls"
    assert finish_reason_with_tools("length", made) == "length"
    assert finish_reason_with_tools("stop", None) == "stop"
    assert finish_reason_with_tools("stop", []) == "stop"
    assert finish_reason_with_tools(None, None) is None


# -- parser_for_template --------------------------------------------------------------------------

# Snippets of the real templates (tokenizer_config.json chat_template), where they teach the format.
QWEN25 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n" }}
    {{- "You are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}"""  # noqa: E501
HERMES2PRO = r"""{{- bos_token }}
{{- '<|im_start|>system\nYou are a function calling AI model. You are provided with function signatures within <tools></tools> XML tags.' }}
{{- "For each function call return a json object with function name and arguments within <tool_call></tool_call> XML tags as follows:\n" }}
{{- "<tool_call>\n" }}
{{- '{"name": <function-name>, "arguments": <args-dict>}\n' }}
{{- '</tool_call><|im_end|>\n' }}"""  # noqa: E501
MISTRAL_V3 = r"""{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}...{%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
        {%- endif %}
        {{- "[INST] " + message["content"] + "[/INST]" }}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}"""
LLAMA31 = r"""{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
    {{- "Given the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
            {{- '<|python_tag|>' + tool_call.name + '.call(' }}"""  # noqa: E501
LLAMA32_PYTHONIC = r"""{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{{- "You are an expert in composing functions. You are given a question and a set of possible functions.\n" }}
{{- "If you decide to invoke any of the function(s), you MUST put it in the format of [func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]\n" }}
{{- "You SHOULD NOT include any other text in the response.\n" }}"""  # noqa: E501
SMOLLM2 = r"""{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system
You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>
' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant
' }}{% endif %}"""  # noqa: E501


@pytest.mark.parametrize("template,parser", [
    (QWEN25, "hermes"), (HERMES2PRO, "hermes"), (MISTRAL_V3, "mistral"), (LLAMA31, "llama3_json"),
    (LLAMA32_PYTHONIC, "pythonic"), (SMOLLM2, None), (None, None), ("", None),
    (QWEN25 + MISTRAL_V3, None),  # two formats: ambiguous
])
def test_parser_for_template(template, parser):
    assert parser_for_template(template) == parser


def test_parser_names():
    assert TOOL_PARSERS == ("hermes", "llama3_json", "mistral", "pythonic")


@pytest.mark.parametrize("parser,text", [
    ("hermes", HERMES_CALL),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}'),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'),
    ("pythonic", '[get_weather(city="Paris")]'),
])
def test_each_parser_reads_only_its_format(parser, text):
    """The same call in the four formats: each parser reads its own and leaves the others as text."""
    assert pairs(calls(text, parser)) == [("get_weather", {"city": "Paris"})]
    for other in TOOL_PARSERS:
        if other != parser and not (other == "mistral" and parser == "pythonic"):
            assert_text(calls(text, other), text)


DEEP = 20_000
NEST = "[" * DEEP + "]" * DEEP


@pytest.mark.parametrize("parser,text", [
    ("hermes", '<tool_call>{"name": "ping", "arguments": {"a": ' + NEST + "}}</tool_call>"),
    ("llama3_json", '{"name": "ping", "parameters": {"a": ' + NEST + "}}"),
    ("mistral", '[TOOL_CALLS]ping[ARGS]{"a": ' + NEST + "}"),
    ("pythonic", "[ping(a=" + NEST + ")]"),
])
def test_nesting_deeper_than_the_stack_is_text(parser, text):
    """A runaway output nested past Python's recursion limit is text, not a crash of the worker."""
    assert_text(calls(text, parser), text)
