"""Anthropic Message Batches result lines (``--format anthropic``), parsed by the ``anthropic``
package's ``MessageBatchIndividualResponse`` (strict, no unknown keys, values compared back)."""

from __future__ import annotations

import json
import re

import pytest
from anthropic.types.messages import MessageBatchIndividualResponse
from output_lines import TIME, WEATHER, completed, failed, output, parse_exactly

from batchinfer.jobs.anthropic_lines import ERROR_TYPES, anthropic_line
from batchinfer.protocol.rows import encode_vector

MESSAGES = "/v1/messages"


def parsed(row: dict) -> MessageBatchIndividualResponse:
    return parse_exactly(MessageBatchIndividualResponse, json.loads(anthropic_line(row)))


def test_succeeded_text_message():
    got = parsed(completed(MESSAGES))
    assert got.custom_id == "req-1" and got.result.type == "succeeded"
    message = got.result.message
    assert re.fullmatch(r"msg_[0-9a-f]{24}", message.id) and message.role == "assistant"
    assert [(b.type, b.text) for b in message.content] == [("text", "Hello there")]
    assert (message.stop_reason, message.stop_sequence, message.model) == ("end_turn", None, "tiny-llama")
    # Anthropic's input_tokens leaves out the tokens read from the cache
    usage = message.usage
    assert (usage.input_tokens, usage.cache_read_input_tokens, usage.cache_creation_input_tokens,
            usage.output_tokens) == (4, 8, 0, 3)
    assert parsed(completed(MESSAGES)).result.message.id == message.id  # stable
    assert parsed(completed(MESSAGES, request_id="job-1:1")).result.message.id != message.id


def test_tool_use_blocks():
    row = completed(MESSAGES, output(text="Let me look.", finish="tool_calls", calls=[WEATHER, TIME]))
    message = parsed(row).result.message
    assert [b.type for b in message.content] == ["text", "tool_use", "tool_use"]
    weather = message.content[1]
    assert weather.id == "toolu_Wx1b2c3d4e5f6g7h8i9j0k1l" and weather.name == "get_weather"
    assert weather.input == {"city": "Paris", "unit": "celsius"}  # an object, not the JSON text
    assert message.stop_reason == "tool_use" and message.stop_sequence is None
    only_calls = parsed(completed(MESSAGES, output(text="", finish="tool_calls", calls=[TIME])))
    assert [b.type for b in only_calls.result.message.content] == ["tool_use"]


def test_stop_reasons():
    def stop(*args, **kwargs) -> tuple:
        message = parsed(completed(MESSAGES, output(*args, **kwargs))).result.message
        return message.stop_reason, message.stop_sequence

    assert stop(finish="length") == ("max_tokens", None)
    assert stop(stop_reason="\n\nHuman:") == ("stop_sequence", "\n\nHuman:")
    assert stop(stop_reason=2) == ("end_turn", None)  # an EOS / stop token id is the turn's end
    # only the first completion counts (Anthropic has no n)
    first = parsed(completed(MESSAGES, output(text="a"), output(text="b", index=1))).result.message
    assert [b.text for b in first.content] == ["a"]


@pytest.mark.parametrize(("code", "kind"), [("invalid_json", "invalid_request_error"),
                                            ("invalid_request", "invalid_request_error"),
                                            ("prompt_too_long", "invalid_request_error"),
                                            ("unknown_model", "not_found_error"),
                                            ("engine_error", "api_error"),
                                            ("dead_lettered", "api_error"),
                                            ("something_new", "api_error")])
def test_errored_results_map_our_codes(code, kind):
    got = parsed(failed(code=code, url=MESSAGES))
    assert got.custom_id == "req-3" and got.result.type == "errored"
    assert got.result.error.type == "error" and got.result.error.error.type == kind
    assert got.result.error.error.message == "line 4: temperature: bad"
    assert ERROR_TYPES.get(code, "api_error") == kind


def test_canceled_and_expired():
    assert json.loads(anthropic_line(failed("cancelled", None, "cancelled"))) == {
        "custom_id": "req-3", "result": {"type": "canceled"}}
    assert parsed(failed("expired", None, "expired")).result.type == "expired"


def test_rows_without_a_message_shape():
    # no custom_id (a plain line): the request id names it
    assert parsed({**completed(None), "custom_id": None}).custom_id == "job-1:0"
    embedding = {"request_id": "j:0", "custom_id": "e0", "status": "completed",
                 "embeddings": [encode_vector([0.5, 0.25])]}
    got = parsed(embedding)
    assert got.result.type == "errored" and "--format openai" in got.result.error.error.message
