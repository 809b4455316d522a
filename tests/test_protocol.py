"""The wire protocol: intake entries, request bodies (plain and OpenAI Batch), rows, job ids."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchinfer.protocol import (
    PROTOCOL_VERSION,
    REQUEST_FIELDS,
    BatchRequest,
    IntakeEntry,
    RequestError,
    RequestSpec,
    ResultRow,
    parse_body,
    valid_job_id,
)
from batchinfer.workers.outputs import CompletionOutput, RequestOutput
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
    ({"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},
     "unsupported_url", "url", ["/v1/embeddings", "/v1/chat/completions"]),
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
    (chat_line(response_format={"type": "json_object"}), "invalid_request", "response_format",
     ["unknown field", "response_format"]),
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


# -- intake entries --------------------------------------------------------------------------------


def test_intake_entry_round_trip():
    entry = IntakeEntry(body='{"prompt":"x"}', job_id="job-1", idx=4, line=5, reply_to="{bi}:reply:1",
                        client_request_id="abc")
    fields = entry.to_fields()
    assert fields["v"] == PROTOCOL_VERSION and fields["idx"] == "4"
    raw = {k.encode(): v.encode() for k, v in fields.items()}
    assert IntakeEntry.from_fields(raw) == entry
    direct = IntakeEntry(body="{}")
    assert direct.to_fields() == {"v": "1", "body": "{}"}
    assert IntakeEntry.from_fields(direct.to_fields()) == direct


BAD_ENTRIES = [
    ({b"body": b"{}"}, "v", "no protocol version"),
    ({b"v": b"2", b"body": b"{}"}, "v", "unsupported protocol version v='2'"),
    ({b"v": b"1"}, "body", "no 'body' field"),
    ({b"v": b"1", b"body": b"{}", b"colour": b"red"}, "colour", "unknown intake field(s): colour"),
    ({b"v": b"1", b"body": b"{}", b"job": b"j1"}, "idx", "needs 'idx'"),
    ({b"v": b"1", b"body": b"{}", b"job": b"j1", b"idx": b"-1"}, "idx", "idx must be a non-negative"),
    ({b"v": b"1", b"body": b"{}", b"job": b"j1", b"idx": b"x"}, "idx", "idx must be a non-negative"),
    ({b"v": b"1", b"body": b"{}", b"job": b"a b", b"idx": b"0"}, "job", "job id 'a b' is invalid"),
    ({b"v": b"1", b"body": b"{}", b"job": b"j1", b"idx": b"0", b"line": b"0"}, "line",
     "line must be a positive"),
]


@pytest.mark.parametrize("raw,field,words", BAD_ENTRIES)
def test_bad_intake_entries(raw, field, words):
    with pytest.raises(RequestError) as info:
        IntakeEntry.from_fields(raw)
    err = info.value
    assert err.code == "protocol_error" and err.field == field
    assert words in str(err)


def test_bad_entry_keeps_context_for_its_error_row():
    with pytest.raises(RequestError) as info:
        IntakeEntry.from_fields({b"v": b"9", b"body": b"{}", b"job": b"j1", b"idx": b"7", b"line": b"8",
                                 b"reply_to": b"r"})
    err = info.value
    assert err.context == {"job": "j1", "idx": 7, "line": 8, "reply_to": "r"}
    assert err.line == 8 and str(err).startswith("line 8: ")


def test_non_utf8_entry():
    with pytest.raises(RequestError, match="not UTF-8") as info:
        IntakeEntry.from_fields({b"v": b"1", b"body": b"\xff"})
    assert info.value.code == "protocol_error"


def test_job_ids():
    assert valid_job_id("job_01a2_ff") and valid_job_id("a.b-c")
    for bad in ("", "-x", "a b", "a:b", "é", "x" * 129, "a/b"):
        assert not valid_job_id(bad), bad


# -- batch requests and rows -----------------------------------------------------------------------


def batch_request() -> BatchRequest:
    return BatchRequest(request_id="j:3", job_id="j", idx=3, prompt_token_ids=[1, 2, 3],
                        sampling_params=SamplingParams(max_tokens=2).to_dict(), model="m", line=4,
                        custom_id="c", reply_to=None, metadata={"k": "v"}, created_at=1000,
                        url="/v1/chat/completions")


def test_batch_request_round_trip():
    req = batch_request()
    assert BatchRequest.from_dict(json.loads(json.dumps(req.to_dict()))) == req
    assert req.params().max_tokens == 2
    assert BatchRequest.from_dict({**req.to_dict(), "added_by_a_newer_writer": 1}) == req


def test_result_row_for_request():
    out = RequestOutput(request_id="j:3", prompt_token_ids=[1, 2, 3], num_cached_tokens=2, outputs=[
        CompletionOutput(index=0, text="ab", token_ids=[7, 8], finish_reason="length",
                         logprobs=[{7: -0.1}, {8: -0.2}]),
        CompletionOutput(index=1, text="c", token_ids=[9], finish_reason="stop")], finished=True)
    row = ResultRow.for_request(batch_request(), out, worker="w1", started_at=1500, finished_at=2000)
    assert (row.status, row.output_text, row.output_token_ids, row.finish_reason) == ("completed", "ab",
                                                                                      [7, 8], "length")
    assert (row.prompt_tokens, row.completion_tokens, row.cached_tokens) == (3, 3, 2)
    assert (row.line, row.custom_id, row.worker, row.url) == (4, "c", "w1", "/v1/chat/completions")
    assert row.outputs[0]["logprobs"] == [{"7": -0.1}, {"8": -0.2}]
    again = ResultRow.from_json(row.to_json())
    assert again == row


def test_result_row_error():
    row = ResultRow.error("prompt_too_long", "line 4: too long", request=batch_request())
    assert (row.status, row.error_code, row.job_id, row.idx, row.line) == (
        "failed", "prompt_too_long", "j", 3, 4)
    assert row.finished_at is not None and row.output_text is None
    bare = ResultRow.error("invalid_json", "bad", job_id="j", idx=9, line=10, status="failed")
    assert bare.request_id == "j:9"
    cancelled = ResultRow.error("cancelled", "job cancelled", status="cancelled", request=batch_request())
    assert cancelled.status == "cancelled" and not cancelled.ok
    with pytest.raises(ValueError, match="status must be one of"):
        ResultRow.error("x", "y", job_id="j", idx=1, status="done")
    with pytest.raises(ValueError, match="direct request needs"):
        ResultRow.error("x", "y")


def test_result_row_with_a_lone_surrogate_is_still_sendable():
    row = ResultRow.error("invalid_request", "bad", job_id="j", idx=0, custom_id="a\ud800b")
    text = row.to_json()
    text.encode("utf-8")  # would raise without the ASCII fallback
    assert ResultRow.from_json(text).custom_id == "a\ud800b"
    assert ResultRow.error("x", "é", job_id="j", idx=1).to_json().count("é") == 1  # UTF-8 kept otherwise
