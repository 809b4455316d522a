"""``parse_tools`` (OpenAI's rules for tools / tool_choice / parallel_tool_calls, errors naming the
body path), ``ToolSpec.call_schema`` (checked with jsonschema and compiled and walked with the
default structured backend on the tiny tokenizer) and ``template_messages``."""

from __future__ import annotations

import copy
import json

import jsonschema
import pytest
from tool_schemas import SAMPLE_ARGUMENTS, TOOLS

from batchinfer.workers.models.tiny import tokenizer_files
from batchinfer.workers.structured.backend import StructuredOutputError
from batchinfer.workers.structured.factory import make_backend
from batchinfer.workers.structured_params import StructuredOutputsParams
from batchinfer.workers.text.tokenizer import Tokenizer
from batchinfer.workers.tools import ToolSpec, parse_tools, template_messages

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}


def fn(**function):
    return {"type": "function", "function": function}


# -- parse_tools: accepted ------------------------------------------------------------------------

def test_no_tools_is_none():
    assert parse_tools(None, None, None) is None
    assert parse_tools(None, None, True) is None  # a boolean alone does nothing


def test_defaults_auto_and_parallel():
    spec = parse_tools([WEATHER, TIME])
    assert spec == ToolSpec(tools=[WEATHER, TIME], choice="auto", function=None, parallel=True)
    assert spec.names() == ["get_weather", "get_time"]


@pytest.mark.parametrize("choice", ["none", "auto", "required"])
def test_string_choices(choice):
    spec = parse_tools([WEATHER], choice, False)
    assert (spec.choice, spec.function, spec.parallel) == (choice, None, False)


def test_named_choice():
    spec = parse_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}})
    assert (spec.choice, spec.function) == ("function", "get_time")


def test_tools_are_copied_as_given():
    tools = [copy.deepcopy(WEATHER), fn(name="ping", strict=True, description="")]
    spec = parse_tools(tools)
    tools[0]["function"]["name"] = "changed"
    assert spec.tools == [WEATHER, fn(name="ping", strict=True, description="")]
    assert spec.template_tools() == spec.tools and spec.template_tools() is not spec.tools


def test_realistic_schemas_all_parse():
    assert len(TOOLS) >= 20
    spec = parse_tools(TOOLS, "required")
    assert spec.names() == [t["function"]["name"] for t in TOOLS]
    assert set(SAMPLE_ARGUMENTS) == set(spec.names())


def test_wire_round_trip():
    spec = parse_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}, False)
    d = spec.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert d == {"tools": [WEATHER, TIME], "choice": "function", "function": "get_weather", "parallel": False}
    assert ToolSpec.from_dict(d) == spec


# -- parse_tools: rejected, each naming the field -------------------------------------------------

REJECTED = [
    # (tools, tool_choice, parallel_tool_calls, the message's start)
    (None, "auto", None, "tool_choice: is only allowed when tools"),
    (None, "none", None, "tool_choice: "),
    ({"type": "function"}, None, None, "tools: must be a list"),
    ([], None, None, "tools: empty list"),
    ([WEATHER] * 129, None, None, "tools: 129 tools"),
    ([WEATHER, "get_time"], None, None, "tools[1]: must be an object"),
    ([{"type": "code_interpreter"}], None, None, "tools[0].type: must be 'function'"),
    ([{"function": WEATHER["function"]}], None, None, "tools[0].type: must be 'function'"),
    ([{"type": "function", "function": "get_weather"}], None, None, "tools[0].function: must be an object"),
    ([{"type": "function"}], None, None, "tools[0].function: must be an object"),
    ([{**WEATHER, "cache_control": {}}], None, None, "tools[0]: unknown field(s) cache_control"),
    ([WEATHER, fn(name="x", paramters={})], None, None, "tools[1].function: unknown field(s) paramters"),
    ([fn(description="no name")], None, None, "tools[0].function.name: must be 1-64 characters"),
    ([fn(name="get weather")], None, None, "tools[0].function.name: "),
    ([fn(name="a.b")], None, None, "tools[0].function.name: "),
    ([fn(name="x" * 65)], None, None, "tools[0].function.name: "),
    ([fn(name="")], None, None, "tools[0].function.name: "),
    ([fn(name=7)], None, None, "tools[0].function.name: "),
    ([WEATHER, TIME, WEATHER], None, None, "tools[2].function.name: duplicate function name 'get_weather'"),
    ([fn(name="f", description=3)], None, None, "tools[0].function.description: must be a string"),
    ([fn(name="f", strict="yes")], None, None, "tools[0].function.strict: must be a boolean"),
    ([fn(name="f", parameters="{}")], None, None, "tools[0].function.parameters: must be a JSON schema"),
    ([fn(name="f", parameters=[])], None, None, "tools[0].function.parameters: must be a JSON schema"),
    ([TIME, fn(name="f", parameters={"type": "string"})], None, None,
     "tools[1].function.parameters: must be a schema of type 'object'"),
    ([WEATHER], "sometimes", None, "tool_choice: must be 'none', 'auto', 'required' or"),
    ([WEATHER], "get_weather", None, "tool_choice: must be"),
    ([WEATHER], ["auto"], None, "tool_choice: must be a string or an object"),
    ([WEATHER], {"type": "function", "function": {"name": "get_time"}}, None,
     "tool_choice.function.name: 'get_time' is not one of the tools' functions (get_weather)"),
    ([WEATHER], {"type": "function", "name": "get_weather"}, None, "tool_choice: unknown field(s) name"),
    ([WEATHER], {"type": "function"}, None, "tool_choice.function: must be an object with a name"),
    ([WEATHER], {"type": "function", "function": {}}, None, "tool_choice.function: must be an object"),
    ([WEATHER], {"type": "tool", "function": {"name": "get_weather"}}, None, "tool_choice.type: must be"),
    ([WEATHER], None, "yes", "parallel_tool_calls: must be a boolean"),
    ([WEATHER], None, 1, "parallel_tool_calls: must be a boolean"),
]


@pytest.mark.parametrize("tools,choice,parallel,message", REJECTED)
def test_rejected_names_the_field(tools, choice, parallel, message):
    with pytest.raises(ValueError) as e:
        parse_tools(tools, choice, parallel)
    assert str(e.value).startswith(message), str(e.value)


# -- call_schema ----------------------------------------------------------------------------------

def test_no_schema_for_auto_and_none():
    assert parse_tools([WEATHER], "auto").call_schema() is None
    assert parse_tools([WEATHER], "none").call_schema() is None


def test_required_schema_shape():
    schema = parse_tools([WEATHER, TIME], "required").call_schema()
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    variants = schema["items"]["anyOf"]
    assert [v["properties"]["name"]["const"] for v in variants] == ["get_weather", "get_time"]
    assert variants[0]["properties"]["parameters"] == WEATHER["function"]["parameters"]
    assert all(v["required"] == ["name", "parameters"] and v["additionalProperties"] is False
               for v in variants)
    assert parse_tools([WEATHER, TIME], "required", False).call_schema()["maxItems"] == 1


def test_named_schema_is_that_function_once():
    named = {"type": "function", "function": {"name": "get_time"}}
    schema = parse_tools([WEATHER, TIME], named).call_schema()
    assert schema["maxItems"] == 1 and schema["items"]["properties"]["name"]["const"] == "get_time"
    jsonschema.validate([{"name": "get_time", "parameters": {"zone": "UTC"}}], schema)
    for bad in ([{"name": "get_weather", "parameters": {"city": "Paris"}}],
                [{"name": "get_time", "parameters": {"zone": "UTC"}}] * 2, []):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_required_schema_validates_calls():
    schema = parse_tools([WEATHER, TIME], "required").call_schema()
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}},
                         {"name": "get_time", "parameters": {"zone": "UTC"}}], schema)
    for bad in ([],  # at least one call
                [{"name": "get_weather", "parameters": {"unit": "c"}}],  # city is required
                [{"name": "get_weather", "parameters": {"city": "Paris", "unit": "k"}}],  # enum
                [{"name": "get_time", "parameters": {"zone": "UTC"}, "id": 1}],  # no other keys
                [{"name": "get_weather", "arguments": {"city": "Paris"}}],
                [{"name": "delete_all", "parameters": {}}],
                {"name": "get_time", "parameters": {"zone": "UTC"}}):  # a list, not one object
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_absent_or_untyped_parameters_mean_an_object():
    schema = parse_tools([fn(name="ping"), fn(name="echo", parameters={"properties": {}})],
                         "required").call_schema()
    jsonschema.validate([{"name": "ping", "parameters": {}}, {"name": "echo", "parameters": {"a": 1}}],
                        schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "echo", "parameters": "text"}], schema)


def test_refs_follow_their_schema_to_the_root():
    """A pydantic-style ``$defs``/``$ref`` schema still resolves once nested in the call list."""
    schema = parse_tools(TOOLS, {"type": "function", "function": {"name": "create_invoice"}}).call_schema()
    call = {"name": "create_invoice", "parameters": SAMPLE_ARGUMENTS["create_invoice"]}
    jsonschema.validate([call], schema)
    bad = copy.deepcopy(call)
    bad["parameters"]["lines"][0]["quantity"] = 0  # Line.quantity minimum 1, behind a $ref
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([bad], schema)


def test_sample_calls_validate_against_the_realistic_schemas():
    spec = parse_tools(TOOLS, "required")
    schema = spec.call_schema()
    calls = [{"name": name, "parameters": args} for name, args in SAMPLE_ARGUMENTS.items()]
    jsonschema.validate(calls, schema)
    for call in calls:  # and each against its own function's parameters, as given
        jsonschema.validate(call["parameters"], spec.parameters(call["name"]))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(calls, parse_tools(TOOLS, "required", False).call_schema())


# -- call_schema through the structured backend ---------------------------------------------------

@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    f = tokenizer_files()
    return Tokenizer.from_files(f["tokenizer.json"], f["tokenizer_config.json"], f["generation_config.json"])


@pytest.fixture(scope="module")
def backend(tok):
    return make_backend("llguidance", tok, 320, tok.eos_token_ids)


def run_matcher(backend, tok, schema, text: str) -> bool:
    """Whether the compiled ``schema`` accepts ``text`` token by token and may end there."""
    m = backend.matcher(backend.compile(StructuredOutputsParams(json=schema)))
    return all(m.accept(t) for t in tok.encode(text, add_special_tokens=False)) and m.is_accepting


def compact(value) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def test_realistic_call_schema_compiles_and_accepts_each_sample(backend, tok):
    schema = parse_tools(TOOLS, "required").call_schema()
    for name, args in SAMPLE_ARGUMENTS.items():
        assert run_matcher(backend, tok, schema, compact([{"name": name, "parameters": args}])), name
    two = [{"name": n, "parameters": SAMPLE_ARGUMENTS[n]} for n in ("get_stock_quote", "send_email")]
    assert run_matcher(backend, tok, schema, compact(two))


def test_compiled_schema_refuses_what_the_schema_refuses(backend, tok):
    schema = parse_tools([WEATHER, TIME], "required", False).call_schema()
    ok = [{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}]
    assert run_matcher(backend, tok, schema, compact(ok))
    no_city = [{"name": "get_weather", "parameters": {"unit": "c"}}]
    assert not run_matcher(backend, tok, schema, compact(no_city))
    assert not run_matcher(backend, tok, schema, compact([{"name": "get_wether", "parameters": {}}]))
    assert not run_matcher(backend, tok, schema, compact(ok * 2))  # parallel_tool_calls false
    assert not run_matcher(backend, tok, schema, "[]")
    invoice = parse_tools(TOOLS, {"type": "function", "function": {"name": "create_invoice"}}).call_schema()
    call = {"name": "create_invoice", "parameters": SAMPLE_ARGUMENTS["create_invoice"]}
    assert run_matcher(backend, tok, invoice, compact([call]))
    call["parameters"]["lines"][0]["quantity"] = 0
    assert not run_matcher(backend, tok, invoice, compact([call]))


def test_unenforceable_schema_does_not_compile(backend):
    """A keyword the backend cannot enforce is refused at compile time (the request is invalid)."""
    tags = fn(name="tag", parameters={"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}})
    schema = parse_tools([tags], "required").call_schema()
    with pytest.raises(StructuredOutputError, match="uniqueItems"):
        backend.compile(StructuredOutputsParams(json=schema))


# -- template_messages ----------------------------------------------------------------------------

CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21"},
]


def test_template_messages_parses_arguments_without_touching_the_input():
    original = copy.deepcopy(CONVERSATION)
    out = template_messages(CONVERSATION)
    assert original == CONVERSATION
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "unit": "c"}
    assert out[0] == CONVERSATION[0] and out[2] == CONVERSATION[2]
    assert out[1]["tool_calls"][0]["id"] == "call_1"


def test_template_messages_leaves_objects_and_other_roles():
    messages = [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}},
                                                     {"function": {"name": "g", "arguments": ""}}]},
                {"role": "user", "content": "x", "tool_calls": [{"function": {"arguments": "not json"}}]}]
    out = template_messages(messages)
    assert [c["function"]["arguments"] for c in out[0]["tool_calls"]] == [{"a": 1}, {}]
    assert out[1] == messages[1]


@pytest.mark.parametrize("arguments,message", [
    ("{city: Paris}", "messages[1].tool_calls[0].function.arguments: not valid JSON"),
    ('["Paris"]', "messages[1].tool_calls[0].function.arguments: must be a JSON object, got list")])
def test_template_messages_bad_arguments_name_the_path(arguments, message):
    messages = copy.deepcopy(CONVERSATION)
    messages[1]["tool_calls"][0]["function"]["arguments"] = arguments
    with pytest.raises(ValueError) as e:
        template_messages(messages)
    assert str(e.value).startswith(message)


# A Llama 3.1-style template: tools as JSON in the prompt, arguments iterated as a mapping.
TEMPLATE = (
    "{% for t in tools %}TOOL {{ t.function.name }} {{ t | tojson }}\n{% endfor %}"
    "{% for m in messages %}{{ m.role }}:"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "{\"name\": \"{{ c.function.name }}\", \"parameters\": {{ c.function.arguments | tojson }}}"
    "{% for k, v in c.function.arguments.items() %} {{ k }}={{ v }}{% endfor %}"
    "{% endfor %}{% else %}{{ m.content }}{% endif %}\n{% endfor %}")


def test_template_renders_tools_and_parsed_calls(tok):
    spec = parse_tools([WEATHER, TIME])
    text = tok.apply_chat_template(template_messages(CONVERSATION), chat_template=TEMPLATE,
                                   add_generation_prompt=False, tools=spec.template_tools())
    assert "TOOL get_weather " in text and "TOOL get_time " in text
    assert '"enum": ["c", "f"]' in text
    call = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}'
    assert f"assistant:{call} city=Paris unit=c" in text
    assert "tool:21" in text
