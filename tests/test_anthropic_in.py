"""Anthropic Message Batches lines (issue 29): ``{"custom_id", "params"}`` mapped onto a chat request,
every accepted field, and the errors, each naming its ``params.`` path."""

from __future__ import annotations

import json

import pytest

from batchinfer.protocol.anthropic_in import PARAMS_FIELDS
from batchinfer.protocol.bodies import parse_body
from batchinfer.protocol.entries import RequestError
from batchinfer.workers.tools import ToolSpec

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"name": "get_weather", "description": "Weather of a city", "input_schema": SCHEMA}
HI = [{"role": "user", "content": "Hello"}]


def line(**params) -> dict:
    return {"custom_id": "a1", "params": {"model": "claude-x", "max_tokens": 16, "messages": HI, **params}}


def error_of(body) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse_body(body)
    return info.value


def test_a_simple_line_is_a_chat_request():
    spec = parse_body(json.dumps(line(system="Be brief.", temperature=0.2, top_p=0.9, top_k=5,
                                      stop_sequences=["\n\n"])))
    assert (spec.url, spec.custom_id, spec.model) == ("/v1/messages", "a1", "claude-x")
    assert spec.messages == [{"role": "system", "content": "Be brief."}, *HI]
    sp = spec.sampling_params
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, sp.stop) == (16, 0.2, 0.9, 5, ["\n\n"])


def test_blocks_become_messages_with_tool_calls_and_tool_results():
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?", "cache_control":
                                      {"type": "ephemeral"}}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "...", "signature": "sig"},
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
             "content": [{"type": "text", "text": "no data"}]},
            {"type": "text", "text": "Thanks!"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_3", "name": "get_weather",
                                           "input": {"city": "Nice"}}]},
    ]
    spec = parse_body(line(system=[{"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
                           messages=messages, tools=[WEATHER]))
    assert spec.messages == [
        {"role": "system", "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}], "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather",
                                                               "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": [{"type": "text", "text": "no data"}]},
        {"role": "user", "content": [{"type": "text", "text": "Thanks!"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "toolu_3", "type": "function", "function": {"name": "get_weather",
                                                               "arguments": '{"city": "Nice"}'}}]}]


@pytest.mark.parametrize("choice,want", [
    (None, ("auto", None, True)),
    ({"type": "auto"}, ("auto", None, True)),
    ({"type": "any"}, ("required", None, True)),
    ({"type": "any", "disable_parallel_tool_use": True}, ("required", None, False)),
    ({"type": "tool", "name": "get_weather"}, ("function", "get_weather", True)),
    ({"type": "none"}, ("none", None, True))])
def test_tools_and_tool_choice_map_onto_chat_tools(choice, want):
    spec = parse_body(line(tools=[WEATHER], tool_choice=choice))
    tools = ToolSpec.from_dict(spec.tools)
    assert tools.tools == [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA,
                                                             "description": "Weather of a city"}}]
    assert (tools.choice, tools.function, tools.parallel) == want
    forced = want[0] in ("required", "function")
    assert (spec.structured_field == "params.tools") is forced
    assert (spec.sampling_params.structured_outputs is not None) is forced


def test_every_accepted_field_is_accepted_and_metadata_keeps_the_user_id():
    params = {"system": "s", "temperature": 1, "top_p": 1, "top_k": 1, "stop_sequences": [],
              "tools": [WEATHER], "tool_choice": {"type": "auto"}, "metadata": {"user_id": "u-7"},
              "stream": False, "thinking": {"type": "enabled", "budget_tokens": 1024},
              "service_tier": "standard_only"}
    assert set(params) | {"model", "max_tokens", "messages"} == set(PARAMS_FIELDS)
    spec = parse_body(line(**params))
    assert spec.metadata == {"user_id": "u-7"}


def test_null_fields_read_as_absent_as_a_parquet_struct_gives_them():
    spec = parse_body(line(system=None, messages=[{"role": "user", "content": [
        {"type": "text", "text": "x", "id": None, "input": None}]}], tools=None))
    assert spec.messages == [{"role": "user", "content": [{"type": "text", "text": "x"}]}]
    assert spec.tools is None


def test_model_is_optional_the_jobs_model_answers():
    spec = parse_body({"custom_id": "a", "params": {"max_tokens": 4, "messages": HI}})
    assert spec.model is None


BAD = [
    ({"params": {"max_tokens": 4, "messages": HI}}, "custom_id", ["missing 'custom_id'"]),
    ({**line(), "body": {}}, "params", ["OpenAI Batch line"]),  # a line with `body` is read as OpenAI's
    ({**line(), "extra": 1}, "extra", ["Anthropic Message Batches line"]),
    ({"custom_id": "a1", "params": "x"}, "params", ["must be an object"]),
    ({"custom_id": "a1", "params": {"messages": HI}}, "params.max_tokens", ["required"]),
    (line(max_tokens=0), "params.max_tokens", [">= 1"]),
    (line(messages=None), "params.messages", ["required"]),
    (line(messages=[]), "params.messages", ["non-empty list"]),
    (line(container="c"), "params.container", ["unknown field"]),
    (line(temperature="hot"), "params.temperature", ["number"]),
    (line(stop_sequences=["a", 3]), "params.stop_sequences[1]",
     ["params.stop_sequences[1] must be a string"]),
    (line(stream=True), "params.stream", ["not supported"]),
    (line(messages=[{"role": "system", "content": "x"}]), "params.messages[0].role", ["params.system"]),
    (line(messages=[{"role": "user", "content": "x", "name": "n"}]), "params.messages[0].name",
     ["not a field"]),
    (line(messages=[{"role": "user", "content": 3}]), "params.messages[0].content", ["string"]),
    (line(messages=[{"role": "user", "content": []}]), "params.messages[0].content", ["non-empty"]),
    (line(messages=[*HI, {"role": "assistant", "content": "a"}, {"role": "user", "content": [
        {"type": "text", "text": "x"}, {"type": "image", "source": {}}]}]),
     "params.messages[2].content[1].type", ["image blocks are not supported", "text only"]),
    (line(messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}]),
     "params.messages[0].content[0].type", ["text only"]),
    (line(messages=[{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                  "input": {}}]}]),
     "params.messages[0].content[0].type", ["text, tool_result"]),
    (line(messages=[{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]),
     "params.messages[0].content[0].type", ["text, tool_use"]),
    (line(messages=[{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                       "input": "{}"}]}]),
     "params.messages[0].content[0].input", ["must be an object"]),
    (line(messages=[{"role": "assistant", "content": [{"type": "tool_use", "name": "f", "input": {}}]}]),
     "params.messages[0].content[0].id", ["string"]),
    (line(messages=[{"role": "user", "content": [{"type": "tool_result", "content": "r"}]}]),
     "params.messages[0].content[0].tool_use_id", ["string"]),
    (line(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                  "is_error": "yes"}]}]),
     "params.messages[0].content[0].is_error", ["boolean"]),
    (line(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                  "content": [{"type": "image", "source": {}}]}]}]),
     "params.messages[0].content[0].content[0].type", ["text only"]),
    (line(messages=[{"role": "user", "content": [{"type": "text"}]}]), "params.messages[0].content[0].text",
     ["string"]),
    (line(system=[{"type": "image"}]), "params.system[0].type", ["text only"]),
    (line(system=5), "params.system", ["string or a list"]),
    (line(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "params.tools[0].type",
     ["only client tools"]),
    (line(tools=[{"name": "f"}]), "params.tools[0].input_schema", ["required"]),
    (line(tools=[{**WEATHER, "name": "get weather"}]), "params.tools[0].name", ["1-64 characters"]),
    (line(tools=[{**WEATHER, "input_schema": {"type": "array"}}]), "params.tools[0].input_schema",
     ["type 'object'"]),
    (line(tools=[WEATHER, WEATHER]), "params.tools[1].name", ["duplicate"]),
    (line(tools=[WEATHER], tool_choice={"type": "tool", "name": "nope"}), "params.tool_choice", ["'nope'"]),
    (line(tools=[WEATHER], tool_choice={"type": "tool"}), "params.tool_choice.name", ["string"]),
    (line(tools=[WEATHER], tool_choice={"type": "any", "name": "get_weather"}), "params.tool_choice.name",
     ["only for type"]),
    (line(tools=[WEATHER], tool_choice={"type": "sometimes"}), "params.tool_choice.type", ["'sometimes'"]),
    (line(tools=[WEATHER], tool_choice={"type": "any", "disable_parallel_tool_use": 1}),
     "params.tool_choice.disable_parallel_tool_use", ["boolean"]),
    (line(tool_choice={"type": "auto"}), "params.tool_choice", ["only allowed when tools"]),
    (line(metadata={"user_id": 5}), "params.metadata.user_id", ["string"]),
    (line(metadata={"team": "a"}), "params.metadata.team", ["not a field"]),
    (line(thinking={"type": "enabled", "budget": 3}), "params.thinking.budget", ["not a field"]),
    (line(service_tier=2), "params.service_tier", ["string"]),
]


@pytest.mark.parametrize("body,field,words", BAD, ids=[f"{i}-{c[1]}" for i, c in enumerate(BAD)])
def test_bad_anthropic_lines_name_their_params_path(body, field, words):
    err = error_of(body)
    assert (err.code, err.field) == ("invalid_request", field), err.message
    for word in words:
        assert word in err.message, (word, err.message)
