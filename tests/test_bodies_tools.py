"""Chat bodies with tools (issue 29): tools / tool_choice / parallel_tool_calls into RequestSpec.tools
and the forced call's structured output; tool-call conversations; the OpenAI fields accepted with no
effect and those refused, each error naming its field."""

from __future__ import annotations

import dataclasses

import pytest

from batchinfer.protocol.bodies import parse_body
from batchinfer.protocol.entries import IGNORED_OPENAI_FIELDS, RequestError
from batchinfer.workers.tools import ToolSpec

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}}}}
USER = [{"role": "user", "content": "Weather in Paris?"}]


def chat_line(**body) -> dict:
    return {"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": USER, **body}}


def error_of(body) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse_body(body)
    return info.value


def test_auto_tools_travel_as_a_spec_and_leave_the_output_free():
    spec = parse_body(chat_line(tools=[WEATHER, SEARCH]))
    tools = ToolSpec.from_dict(spec.tools)
    assert (tools.choice, tools.function, tools.parallel, tools.names()) == ("auto", None, True,
                                                                             ["get_weather", "search"])
    assert spec.sampling_params.structured_outputs is None and spec.structured_field is None


@pytest.mark.parametrize("choice,parallel,max_items", [
    ("required", None, None), ("required", False, 1),
    ({"type": "function", "function": {"name": "search"}}, None, 1)])
def test_required_and_named_choices_force_the_call_schema(choice, parallel, max_items):
    spec = parse_body({"messages": USER, "tools": [WEATHER, SEARCH], "tool_choice": choice,
                       "parallel_tool_calls": parallel})
    tools = ToolSpec.from_dict(spec.tools)
    assert spec.structured_field == "tools"
    assert spec.sampling_params.structured_outputs.json == tools.call_schema()
    assert spec.sampling_params.structured_outputs.json.get("maxItems") == max_items
    # arguments get no keys their function did not declare (objects closed unless they say otherwise)
    assert spec.sampling_params.structured_outputs.disable_additional_properties is True


def test_none_choice_keeps_the_tools_for_the_template_only():
    spec = parse_body(chat_line(tools=[WEATHER], tool_choice="none"))
    assert spec.tools["choice"] == "none" and spec.sampling_params.structured_outputs is None


def test_a_free_response_format_goes_with_a_forced_call():
    spec = parse_body(chat_line(tools=[WEATHER], tool_choice="required", response_format={"type": "text"}))
    assert spec.structured_field == "tools"


def test_a_tool_call_conversation_is_kept_as_given():
    messages = [*USER,
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "sunny"}]}]
    spec = parse_body({"messages": messages, "tools": [WEATHER]})
    assert spec.messages == messages


def test_every_no_effect_openai_field_is_accepted():
    values = {"user": "u-1", "store": True, "service_tier": "flex", "stream_options": {"include_usage": True},
              "reasoning_effort": "low", "safety_identifier": "s", "prompt_cache_key": "k"}
    assert set(values) == set(IGNORED_OPENAI_FIELDS)
    spec = parse_body(chat_line(stream=False, metadata={"k": "v"}, modalities=["text"], **values))
    plain = parse_body(chat_line())
    assert spec.sampling_params == plain.sampling_params and spec.metadata == {"k": "v"}
    assert parse_body({"prompt": "x", **values}).prompt == "x"  # completions too


@pytest.mark.parametrize("content,text", [("The weather is", "The weather is"),
                                          ([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                                           "ab")])
def test_prediction_is_kept_and_changes_nothing_else(content, text):
    spec = parse_body(chat_line(prediction={"type": "content", "content": content}))
    assert spec.prediction == spec.sampling_params.prediction == text  # for the speculative decoder
    without = dataclasses.replace(spec.sampling_params, prediction=None)
    assert without == parse_body(chat_line()).sampling_params


BAD = [
    # (body, field, words)
    (chat_line(tools=[{**WEATHER, "function": {**WEATHER["function"], "name": "get weather"}}]),
     "tools[0].function.name", ["1-64 characters"]),
    (chat_line(tools=[WEATHER, WEATHER]), "tools[1].function.name", ["duplicate"]),
    (chat_line(tools={"a": 1}), "tools", ["list"]),
    (chat_line(tools=[{"type": "code_interpreter"}]), "tools[0].type", ["must be 'function'"]),
    (chat_line(tools=[WEATHER], tool_choice="sometimes"), "tool_choice", ["'sometimes'"]),
    (chat_line(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice.function.name", ["'nope'", "get_weather"]),
    (chat_line(tool_choice="auto"), "tool_choice", ["only allowed when tools"]),
    (chat_line(tools=[WEATHER], parallel_tool_calls="yes"), "parallel_tool_calls", ["boolean"]),
    (chat_line(tools=[WEATHER], tool_choice="required",
               response_format={"type": "json_object"}), "tool_choice", ["give one of them"]),
    (chat_line(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
               guided_regex="a+"), "tool_choice", ["constrain"]),
    ({"custom_id": "c", "method": "POST", "url": "/v1/completions",
      "body": {"prompt": "x", "tools": [WEATHER]}}, "tools", ["completions", "cannot call tools"]),
    ({"prompt": "x", "tool_choice": "none"}, "tool_choice", ["cannot call tools"]),
    # messages of a tool conversation
    ({"messages": [{"role": "tool", "content": "r"}]}, "messages[0].tool_call_id", ["needs tool_call_id"]),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls",
     ["only assistant"]),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function",
                                                                          "function": {"name": "f"}}]}]},
     "messages[0].tool_calls[0].function.arguments", ["JSON text"]),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}]},
     "messages[0].tool_calls[0].function.arguments", ["must be a string"]),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": 1, "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages[0].tool_calls[0].id", ["string"]),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "custom", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages[0].tool_calls[0].type", ["\"function\""]),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}, "index": 0}]}]},
     "messages[0].tool_calls[0].index", ["unknown field"]),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": "f()"}]},
     "messages[0].tool_calls", ["must be a list"]),
    # the refusals that say why
    (chat_line(stream=True), "stream", ["stream: true is not supported"]),
    (chat_line(modalities=["text", "audio"]), "modalities", ["text only"]),
    (chat_line(audio={"voice": "alloy", "format": "wav"}), "audio", ["text only"]),
    *[({"messages": [{"role": "user", "content": [{"type": kind, kind: {}}]}]}, "messages[0].content[0]",
       [f"{kind} parts are not supported", "this model takes text only"])
      for kind in ("image_url", "input_audio", "file")],
    (chat_line(prediction={"type": "text", "content": "x"}), "prediction", ["\"content\""]),
    (chat_line(prediction={"type": "content", "content": [{"type": "image_url"}]}),
     "prediction.content[0]", ["not supported"]),
    ({"prompt": "x", "prediction": {"type": "content", "content": "y"}}, "prediction", ["chat"]),
    # no-effect fields still have their type
    (chat_line(service_tier=3), "service_tier", ["string", "no effect"]),
    (chat_line(store="yes"), "store", ["boolean"]),
    (chat_line(stream_options="x"), "stream_options", ["object"]),
    (chat_line(reasoning_effort=""), "reasoning_effort", ["non-empty string"]),
]


@pytest.mark.parametrize("body,field,words", BAD, ids=[f"{i}-{c[1]}" for i, c in enumerate(BAD)])
def test_bad_tool_bodies_name_their_field(body, field, words):
    err = error_of(body)
    assert (err.code, err.field) == ("invalid_request", field), err.message
    for word in words:
        assert word in err.message, (word, err.message)


def test_tools_are_not_taken_for_an_embeddings_request():
    err = error_of({"input": "x", "tools": [WEATHER]})
    assert err.field == "tools"
