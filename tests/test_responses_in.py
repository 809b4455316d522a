"""OpenAI Batch lines for ``/v1/responses`` (issue 29): the Responses body mapped onto a chat request,
every accepted field, and the errors, each naming its ``body.`` path."""

from __future__ import annotations

import pytest

from batchinfer.protocol.bodies import parse_body
from batchinfer.protocol.entries import RequestError
from batchinfer.protocol.responses_in import RESPONSES_FIELDS
from batchinfer.workers.tools import ToolSpec

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": PARAMS, "strict": True}


def line(**body) -> dict:
    return {"custom_id": "r1", "method": "POST", "url": "/v1/responses", "body": {"model": "m", **body}}


def error_of(body) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse_body(body)
    return info.value


def test_a_string_input_is_one_user_message():
    spec = parse_body(line(input="Hello", instructions="Be brief.", max_output_tokens=7, temperature=0.5,
                           top_p=0.9))
    assert (spec.url, spec.custom_id, spec.model) == ("/v1/responses", "r1", "m")
    assert spec.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    sp = spec.sampling_params
    assert (sp.max_tokens, sp.temperature, sp.top_p) == (7, 0.5, 0.9)


def test_without_max_output_tokens_the_rest_of_the_context():
    assert parse_body(line(input="x")).sampling_params.max_tokens is None


def test_message_items_and_function_calls_become_a_chat_conversation():
    items = [
        {"role": "developer", "content": "Use the tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in "},
                                                         {"type": "input_text", "text": "Paris?"}]},
        {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "id": "fc_1", "call_id": "call_a", "name": "get_weather",
         "arguments": '{"city": "Paris"}', "status": "completed"},
        {"type": "function_call", "call_id": "call_b", "name": "get_weather",
         "arguments": '{"city": "Nice"}'},
        {"type": "function_call_output", "call_id": "call_a", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_b",
         "output": [{"type": "input_text", "text": "rain"}]},
    ]
    spec = parse_body(line(input=items, tools=[WEATHER]))
    assert spec.messages == [
        {"role": "developer", "content": "Use the tools."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in "},
                                     {"type": "text", "text": "Paris?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}], "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris"}'}},
            {"id": "call_b", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Nice"}'}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_b", "content": [{"type": "text", "text": "rain"}]}]


def test_a_function_call_without_a_preceding_assistant_turn_opens_one():
    spec = parse_body(line(input=[{"role": "user", "content": "q"},
                                  {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]))
    assert spec.messages[1] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}


def test_flat_function_tools_and_choices_map_onto_chat_tools():
    spec = parse_body(line(input="x", tools=[WEATHER], parallel_tool_calls=False,
                           tool_choice={"type": "function", "name": "get_weather"}))
    tools = ToolSpec.from_dict(spec.tools)
    assert tools.tools == [{"type": "function", "function": {"name": "get_weather",
                                                             "description": "Weather of a city",
                                                             "parameters": PARAMS, "strict": True}}]
    assert (tools.choice, tools.function, tools.parallel) == ("function", "get_weather", False)
    assert spec.structured_field == "body.tools"
    assert spec.sampling_params.structured_outputs.json == tools.call_schema()
    assert parse_body(line(input="x", tools=[WEATHER])).tools["choice"] == "auto"


def test_text_format_json_schema_is_a_structured_output():
    fmt = {"type": "json_schema", "name": "city", "schema": PARAMS, "strict": True}
    spec = parse_body(line(input="x", text={"format": fmt, "verbosity": "low"}))
    so = spec.sampling_params.structured_outputs
    assert (so.json, so.disable_additional_properties) == (PARAMS, True)
    assert spec.structured_field == "body.text.format.schema"  # what a schema that does not compile names
    assert parse_body(line(input="x", text={"format": {"type": "json_object"}})
                      ).sampling_params.structured_outputs.json_object
    free = parse_body(line(input="x", text={"format": {"type": "text"}}))
    assert free.sampling_params.structured_outputs is None


def test_every_accepted_field_is_accepted():
    body = {"input": "x", "instructions": "i", "max_output_tokens": 3, "temperature": 0, "top_p": 1,
            "text": {"format": {"type": "text"}}, "tools": [WEATHER], "tool_choice": "auto",
            "parallel_tool_calls": True, "metadata": {"k": "v"}, "user": "u", "store": False,
            "service_tier": "auto", "reasoning": {"effort": "low"}, "truncation": "disabled", "stream": False,
            "stream_options": {}, "safety_identifier": "s", "prompt_cache_key": "p"}
    assert set(body) | {"model"} == set(RESPONSES_FIELDS)
    spec = parse_body(line(**body))
    assert spec.metadata == {"k": "v"} and spec.url == "/v1/responses"


BAD = [
    (line(), "body.input", ["needs 'input'"]),
    (line(input=[]), "body.input", ["at least one message"]),
    (line(input=5), "body.input", ["string or a list"]),
    (line(input="x", previous_response_id="resp_1"), "body.previous_response_id", ["unknown field"]),
    (line(input="x", max_output_tokens=0), "body.max_output_tokens", ["body.max_output_tokens must be >= 1"]),
    (line(input="x", temperature=-1), "body.temperature", [">= 0"]),
    (line(input=[{"role": "bot", "content": "x"}]), "body.input[0].role", ["'bot'"]),
    (line(input=[{"role": "user", "content": "x", "name": "n"}]), "body.input[0].name", ["not a field"]),
    (line(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]),
     "body.input[0].content[0].type", ["this model takes text only"]),
    (line(input=[{"role": "user", "content": [{"type": "input_text"}]}]), "body.input[0].content[0].text",
     ["must be a string"]),
    (line(input=[{"type": "item_reference", "id": "x"}]), "body.input[0].type", ["'item_reference'"]),
    (line(input=[{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]),
     "body.input[0].arguments", ["must be a string"]),
    (line(input=[{"type": "function_call_output", "output": "r"}]), "body.input[0].call_id", ["string"]),
    (line(input="x", instructions=3), "body.instructions", ["string"]),
    (line(input="x", text={"format": {"type": "json_schema", "schema": PARAMS}}), "body.text.format.name",
     ["requires a name"]),
    (line(input="x", text={"format": {"type": "yaml"}}), "body.text.format.type", ["'yaml'"]),
    (line(input="x", text={"format": {"type": "json_schema", "name": "n", "json_schema": {}}}),
     "body.text.format.json_schema", ["not a field"]),
    (line(input="x", tools=[{"type": "web_search"}]), "body.tools[0].type", ["only function tools"]),
    (line(input="x", tools=[{**WEATHER, "name": "get weather"}]), "body.tools[0].name", ["1-64 characters"]),
    (line(input="x", tools=[{**WEATHER, "parameters": {"type": "string"}}]), "body.tools[0].parameters",
     ["type 'object'"]),
    (line(input="x", tools=[WEATHER], tool_choice={"type": "function", "name": "nope"}),
     "body.tool_choice.name", ["'nope'"]),
    (line(input="x", tools=[WEATHER], tool_choice={"type": "file_search"}), "body.tool_choice.type",
     ["not supported"]),
    (line(input="x", tools=[WEATHER], tool_choice="required",
          text={"format": {"type": "json_object"}}), "body.tool_choice", ["give one of them"]),
    (line(input="x", truncation="auto"), "body.truncation", ["disabled"]),
    (line(input="x", reasoning="high"), "body.reasoning", ["object"]),
    (line(input="x", stream=True), "body.stream", ["not supported"]),
    (line(input="x", service_tier=1), "body.service_tier", ["string"]),
    (line(input="x", custom_id="c"), "body.custom_id", ["belongs to the Batch line"]),
]


@pytest.mark.parametrize("body,field,words", BAD, ids=[f"{i}-{c[1]}" for i, c in enumerate(BAD)])
def test_bad_responses_bodies_name_their_body_path(body, field, words):
    err = error_of(body)
    assert (err.code, err.field) == ("invalid_request", field), err.message
    for word in words:
        assert word in err.message, (word, err.message)
    assert err.context == {"custom_id": "r1"}  # the error row still carries the caller's id
