"""Request bodies (plain and OpenAI Batch): the specs they give, the errors they raise, fuzzing."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchinfer.protocol.bodies import RequestSpec, parse_body
from batchinfer.protocol.entries import REQUEST_FIELDS, RequestError
from batchinfer.workers.sampling_params import SamplingParams


def chat_line(**body) -> dict:
    return {"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}}


def completion_line(**body) -> dict:
    return {"custom_id": "c2", "method": "POST", "url": "/v1/completions",
            "body": {"model": "m", "prompt": "Hello", **body}}


def error_of(body, **kwargs) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse_body(body, **kwargs)
    return info.value


# -- good bodies -------------------------------------------------------------------------------------


def test_plain_prompt_with_sampling_fields():
    spec = parse_body('{"custom_id": "a", "model": "m", "prompt": "Hi", "max_tokens": 5, "temperature": 0,'
                      ' "stop": "x", "seed": 7, "ignore_eos": true, "priority": 3, "metadata": {"k": "v"}}')
    assert isinstance(spec, RequestSpec)
    assert (spec.custom_id, spec.model, spec.prompt, spec.priority, spec.metadata) == ("a", "m", "Hi", 3,
                                                                                        {"k": "v"})
    sp = spec.sampling_params
    assert (sp.max_tokens, sp.temperature, sp.stop, sp.seed, sp.ignore_eos) == (5, 0.0, ["x"], 7, True)
    assert spec.url is None and spec.messages is None and spec.prompt_token_ids is None


def test_plain_prompt_token_ids_and_defaults():
    spec = parse_body({"prompt_token_ids": [1, 2, 3]})
    assert spec.prompt_token_ids == [1, 2, 3]
    assert spec.model is None and spec.custom_id is None and spec.priority == 0
    assert spec.sampling_params.max_tokens == 16  # as /v1/completions


def test_assistant_message_with_tool_calls_may_omit_content():
    spec = parse_body({"messages": [{"role": "user", "content": "q"},
                                    {"role": "assistant", "content": None, "tool_calls": [
                                        {"id": "t1", "type": "function",
                                         "function": {"name": "f", "arguments": "{}"}}]},
                                    {"role": "tool", "content": "r", "tool_call_id": "t1"}]})
    assert spec.messages[1]["content"] is None


def test_plain_messages_default_to_rest_of_context():
    spec = parse_body({"messages": [{"role": "system", "content": "be brief"},
                                    {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                 {"type": "text", "text": "b"}]}]})
    assert spec.sampling_params.max_tokens is None
    assert spec.messages[1]["content"] == [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]


def test_openai_chat_line_is_mapped():
    spec = parse_body(chat_line(max_completion_tokens=9, logprobs=True, top_logprobs=3, user="u1",
                                stream=False))
    assert spec.custom_id == "c1" and spec.model == "m" and spec.url == "/v1/chat/completions"
    assert spec.messages == [{"role": "user", "content": "hi"}]
    assert spec.sampling_params.max_tokens == 9
    assert spec.sampling_params.logprobs == 3


def test_openai_chat_logprobs_without_top_is_zero():
    assert parse_body(chat_line(logprobs=True)).sampling_params.logprobs == 0
    assert parse_body(chat_line(logprobs=False)).sampling_params.logprobs is None


def test_openai_completion_line_is_mapped():
    spec = parse_body(completion_line(max_tokens=4, logprobs=2, echo=False))
    assert spec.prompt == "Hello" and spec.url == "/v1/completions"
    assert spec.sampling_params.logprobs == 2 and spec.sampling_params.max_tokens == 4


def test_openai_completion_prompt_forms():
    assert parse_body(completion_line(prompt=["one"])).prompt == "one"
    assert parse_body(completion_line(prompt=[5, 6])).prompt_token_ids == [5, 6]


def test_bytes_body_and_explicit_nulls():
    spec = parse_body(b'{"prompt": "x", "messages": null, "seed": null, "max_tokens": null}')
    assert spec.prompt == "x" and spec.sampling_params.seed is None
    assert spec.sampling_params.max_tokens is None


def test_same_value_in_both_max_token_names_is_fine():
    spec = parse_body({"prompt": "x", "max_tokens": 3, "max_completion_tokens": 3})
    assert spec.sampling_params.max_tokens == 3


# -- bad bodies: the code, the field and the line are named ----------------------------------------

BAD_BODIES = [
    # (body, code, field, words the message must contain)
    ("{not json", "invalid_json", None, ["invalid JSON"]),
    ("", "invalid_json", None, ["invalid JSON"]),
    ('{"prompt": "x", "temperature": NaN}', "invalid_json", None, ["NaN"]),
    ('{"prompt": "x", "temperature": Infinity}', "invalid_json", None, ["Infinity"]),
    (b"\xff\xfe", "invalid_json", None, ["UTF-8"]),
    ("[1, 2]", "invalid_request", None, ["JSON object", "list"]),
    ('"text"', "invalid_request", None, ["JSON object", "string"]),
    ({"prompt": "x", "foo": 1, "bar": 2}, "invalid_request", "bar", ["unknown field", "bar", "foo"]),
    # the in-process engine's knob is no field of a queued request
    ({"prompt": "x", "output_kind": "final_only"}, "invalid_request", "output_kind", ["unknown field"]),
    ({}, "invalid_request", "prompt", ["exactly one of", "got none"]),
    ({"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, "invalid_request", "messages",
     ["exactly one", "prompt, messages"]),
    ({"prompt": ""}, "invalid_request", "prompt", ["must not be empty"]),
    ({"prompt": 12}, "invalid_request", "prompt", ["prompt must be a string"]),
    ({"prompt": ["a", "b"]}, "invalid_request", "prompt", ["one prompt per request"]),
    ({"prompt_token_ids": []}, "invalid_request", "prompt_token_ids", ["non-empty list"]),
    ({"prompt_token_ids": [1, -2]}, "invalid_request", "prompt_token_ids[1]", ["prompt_token_ids[1]", "-2"]),
    ({"prompt_token_ids": [1, True]}, "invalid_request", "prompt_token_ids[1]", ["token id"]),
    ({"messages": []}, "invalid_request", "messages", ["non-empty list"]),
    ({"messages": ["hi"]}, "invalid_request", "messages[0]", ["messages[0] must be an object"]),
    ({"messages": [{"role": "bot", "content": "x"}]}, "invalid_request", "messages[0].role", ["'bot'"]),
    ({"messages": [{"role": "user"}]}, "invalid_request", "messages[0].content", ["messages[0].content"]),
    ({"messages": [{"role": "assistant", "content": None}]}, "invalid_request", "messages[0].content",
     ["string or a list of text parts"]),
    ({"messages": [{"role": "user", "content": "a", "x": 1}]}, "invalid_request", "messages[0].x",
     ["unknown field", "x"]),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "invalid_request", "messages[0].content[0]", ["only text"]),
    ({"messages": [{"role": "user", "content": "a", "name": 3}]}, "invalid_request", "messages[0].name",
     ["must be a string"]),
    ({"prompt": "x", "custom_id": 5}, "invalid_request", "custom_id", ["custom_id must be a string"]),
    ({"prompt": "x", "custom_id": "c" * 600}, "invalid_request", "custom_id", ["at most 512"]),
    ({"prompt": "x", "model": ""}, "invalid_request", "model", ["model must be a non-empty string"]),
    ({"prompt": "x", "priority": "high"}, "invalid_request", "priority", ["priority must be an integer"]),
    ({"prompt": "x", "priority": True}, "invalid_request", "priority", ["integer"]),
    ({"prompt": "x", "metadata": ["a"]}, "invalid_request", "metadata", ["object of strings"]),
    ({"prompt": "x", "metadata": {"k": 1}}, "invalid_request", "metadata.k", ["metadata.k must be a string"]),
    ({"prompt": "x", "stream": True}, "invalid_request", "stream", ["stream: true is not supported"]),
    ({"prompt": "x", "temperature": -1}, "invalid_request", "temperature", ["temperature", ">= 0"]),
    ({"prompt": "x", "max_tokens": 0}, "invalid_request", "max_tokens", ["max_tokens"]),
    ({"prompt": "x", "max_tokens": "5"}, "invalid_request", "max_tokens", ["max_tokens must be an integer"]),
    ({"prompt": "x", "stop": ["a", 3]}, "invalid_request", "stop[1]", ["stop[1] must be a string"]),
    ({"prompt": "x", "top_p": 1.5}, "invalid_request", "top_p", ["top_p"]),
    ({"prompt": "x", "max_tokens": 3, "max_completion_tokens": 4}, "invalid_request", "max_completion_tokens",
     ["one of max_tokens and max_completion_tokens"]),
    # OpenAI Batch lines
    ({"custom_id": "a", "method": "POST", "url": "/v1/moderations", "body": {"input": "x"}},
     "unsupported_url", "url", ["/v1/moderations", "/v1/chat/completions", "/v1/embeddings"]),
    ({"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {"prompt": "x"}},
     "invalid_request", "method", ["POST", "GET"]),
    ({"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x"}}, "invalid_request", "method",
     ["missing 'method'"]),
    ({"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}, "invalid_request", "custom_id",
     ["missing 'custom_id'"]),
    ({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": "x"}, "invalid_request", "body",
     ["body must be an object"]),
    ({**completion_line(), "extra": 1}, "invalid_request", "extra", ["OpenAI Batch line", "extra"]),
    (chat_line(stream=True), "invalid_request", "stream", ["stream: true"]),
    (chat_line(custom_id="x"), "invalid_request", "body.custom_id", ["belongs to the Batch line"]),
    (chat_line(prompt="x"), "invalid_request", "body.prompt", ["takes 'messages'"]),
    (chat_line(logprobs=3), "invalid_request", "logprobs", ["logprobs must be a boolean"]),
    (chat_line(top_logprobs=3), "invalid_request", "top_logprobs", ["needs logprobs: true"]),
    (chat_line(response_format={"type": "xml"}), "invalid_request", "response_format.type",
     ["response_format.type must be one of text, json_object, json_schema", "'xml'"]),
    ({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m"}},
     "invalid_request", "body.messages", ["needs 'messages'"]),
    ({"custom_id": "a", "method": "POST", "url": "/v1/completions",
      "body": {"messages": [{"role": "user", "content": "x"}]}}, "invalid_request", "body.messages",
     ["takes 'prompt'"]),
    (completion_line(echo=True), "invalid_request", "body.echo", ["echo is not supported"]),
    (completion_line(suffix="s"), "invalid_request", "body.suffix", ["suffix is not supported"]),
]


@pytest.mark.parametrize("body,code,field,words", BAD_BODIES,
                         ids=[f"{i}-{c[1]}-{c[2]}" for i, c in enumerate(BAD_BODIES)])
def test_bad_bodies_name_code_field_and_line(body, code, field, words):
    err = error_of(body, line=42)
    assert err.code == code
    assert err.field == field
    assert err.line == 42
    text = str(err)
    assert text.startswith("line 42: ")
    for word in words:
        assert word in text, (word, text)


def test_failed_body_keeps_custom_id_for_its_error_row():
    assert error_of({"custom_id": "mine", "prompt": "x", "temperature": -1}).context == {"custom_id": "mine"}
    assert error_of(chat_line(stream=True)).context == {"custom_id": "c1"}
    assert error_of({"custom_id": 7, "prompt": 1}).context == {}
    assert error_of("{broken").context == {}


def test_max_tokens_limit():
    err = error_of({"prompt": "x", "max_tokens": 2000}, max_tokens_limit=1000)
    assert (err.code, err.field) == ("invalid_request", "max_tokens")
    assert "<= 1000" in str(err)
    spec = parse_body({"prompt": "x", "max_tokens": 1000}, max_tokens_limit=1000)
    assert spec.sampling_params.max_tokens == 1000


def test_deep_nesting_is_a_request_error():
    err = error_of('{"prompt": "x", "metadata": ' + "[" * 100_000 + "]" * 100_000 + "}")
    assert err.code in ("invalid_json", "invalid_request")


def test_error_without_line_has_no_prefix():
    err = error_of({"prompt": 1})
    assert err.line is None and str(err).startswith("prompt must be")


# -- fuzzing: parse_body raises nothing but RequestError ---------------------------------------------

KNOWN_KEYS = list(REQUEST_FIELDS) + list(SamplingParams.FIELDS) + [
    "method", "url", "body", "stream", "max_completion_tokens", "top_logprobs", "user", "echo"]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(
        st.sampled_from(KNOWN_KEYS + ["role", "content", "type", "text"]) | st.text(max_size=5),
        children, max_size=5),
    max_leaves=20,
)
bodies = st.dictionaries(st.sampled_from(KNOWN_KEYS) | st.text(max_size=8), json_values, max_size=8)
openai_lines = st.fixed_dictionaries({
    "custom_id": json_values, "method": st.sampled_from(["POST", "post", "GET"]) | json_values,
    "url": st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/x"]), "body": bodies})


@settings(max_examples=250, deadline=None)
@given(st.one_of(bodies, openai_lines, json_values, st.text(max_size=200), st.binary(max_size=60)))
def test_parse_body_raises_only_request_errors(body):
    for candidate in (body, _as_json(body)):
        if candidate is None:
            continue
        try:
            spec = parse_body(candidate, line=3)
        except RequestError as e:
            assert e.code and e.line == 3 and str(e).startswith("line 3: ")
        else:
            assert isinstance(spec.sampling_params, SamplingParams)
            assert sum(x is not None for x in (spec.prompt, spec.prompt_token_ids, spec.messages)) == 1


def _as_json(value) -> str | None:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return None
