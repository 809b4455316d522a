"""OpenAI batch output lines (``--format openai``), each body parsed by the ``openai`` package's own
models (strict, no unknown keys, values compared back: ``output_lines.parse_exactly``)."""

from __future__ import annotations

import json
import re

import numpy as np
from openai.types import Completion, CreateEmbeddingResponse
from openai.types.chat import ChatCompletion
from openai.types.responses import Response
from output_lines import CHAT, CMPL, EMB, RESP, TIME, WEATHER, completed, failed, output, parse_exactly

from batchinfer.jobs.openai_lines import openai_line
from batchinfer.protocol.rows import encode_vector


def line(row: dict) -> dict:
    return json.loads(openai_line(row))


def body(row: dict) -> dict:
    got = line(row)
    assert got["error"] is None and got["response"]["status_code"] == 200
    return got["response"]["body"]


# -- chat completions ------------------------------------------------------------------------------


def test_chat_text_completion_parses_and_carries_usage_and_fingerprint():
    chat = parse_exactly(ChatCompletion, body(completed(CHAT)))
    choice = chat.choices[0]
    message = choice.message
    assert (message.content, message.tool_calls, message.refusal) == ("Hello there", None, None)
    assert choice.finish_reason == "stop" and chat.model == "tiny-llama" and chat.created == 1_700_000_002
    usage = chat.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (12, 3, 15)
    assert usage.prompt_tokens_details.cached_tokens == 8
    details = usage.completion_tokens_details
    assert (details.reasoning_tokens, details.accepted_prediction_tokens, details.rejected_prediction_tokens,
            details.audio_tokens) == (0, 0, 0, 0)
    assert chat.service_tier == "default"
    # one fingerprint per model (and batchinfer version), as OpenAI's changes with its backend
    assert re.fullmatch(r"fp_[0-9a-f]{10}", chat.system_fingerprint)
    assert body(completed(CHAT, request_id="job-2:5"))["system_fingerprint"] == chat.system_fingerprint
    assert body(completed(CHAT, model="other"))["system_fingerprint"] != chat.system_fingerprint


def test_chat_usage_carries_the_rows_prediction_counts():
    row = completed(CHAT, accepted_prediction_tokens=9, rejected_prediction_tokens=4)
    details = parse_exactly(ChatCompletion, body(row)).usage.completion_tokens_details
    assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (9, 4)
    # no prediction (null counts, or a row written before the fields): OpenAI's zeros, still ints
    for plain in (completed(CHAT, accepted_prediction_tokens=None, rejected_prediction_tokens=None),
                  completed(CHAT)):
        got = body(plain)["usage"]["completion_tokens_details"]
        assert (got["accepted_prediction_tokens"], got["rejected_prediction_tokens"]) == (0, 0)


def test_chat_tool_calls_only_have_null_content():
    row = completed(CHAT, output(text="", finish="tool_calls", calls=[WEATHER, TIME]))
    chat = parse_exactly(ChatCompletion, body(row))
    message = chat.choices[0].message
    assert message.content is None and chat.choices[0].finish_reason == "tool_calls"
    assert [c.model_dump() for c in message.tool_calls] == [WEATHER, TIME]
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Paris", "unit": "celsius"}


def test_chat_text_and_calls_and_n_choices_each_with_their_own():
    row = completed(CHAT, output(text="Let me check.", finish="tool_calls", calls=[WEATHER]),
                    output(text="It is sunny.", index=1),
                    output(text="", finish="tool_calls", calls=[TIME], index=2))
    chat = parse_exactly(ChatCompletion, body(row))
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert [c.message.content for c in chat.choices] == ["Let me check.", "It is sunny.", None]
    assert [[t.id for t in c.message.tool_calls or ()] for c in chat.choices] == [[WEATHER["id"]], [],
                                                                                 [TIME["id"]]]
    assert [c.finish_reason for c in chat.choices] == ["tool_calls", "stop", "tool_calls"]
    # a call the row holds beyond OpenAI's keys is not passed on
    extra = {**WEATHER, "index": 0, "function": {**WEATHER["function"], "parsed": {}}}
    assert body(completed(CHAT, output(calls=[extra])))["choices"][0]["message"]["tool_calls"] == [WEATHER]


def test_chat_length_stop_string_and_logprobs():
    steps = [{"token_id": 5, "token": "Hi", "bytes": [72, 105], "logprob": -0.5,
              "top_logprobs": [{"token_id": 5, "token": "Hi", "bytes": [72, 105], "logprob": -0.5}]}]
    row = completed(CHAT, output(text="Hi", finish="length", logprobs=steps),
                    output(text="Yo", stop_reason=".", index=1))
    chat = parse_exactly(ChatCompletion, body(row))
    assert [c.finish_reason for c in chat.choices] == ["length", "stop"]
    first = chat.choices[0].logprobs.content[0]
    assert (first.token, first.bytes) == ("Hi", [72, 105])
    assert chat.choices[1].logprobs is None
    # bytes read back from Parquet are Python bytes: still a list of ints in the line
    steps[0]["bytes"] = b"Hi"
    again = body(completed(CHAT, output(logprobs=steps)))["choices"][0]["logprobs"]["content"][0]
    assert again["bytes"] == [72, 105]


def test_messages_lines_answer_as_chat():
    assert body(completed("/v1/messages"))["object"] == "chat.completion"


# -- completions and embeddings -------------------------------------------------------------------


def test_text_completion_parses():
    steps = [{"token_id": 5, "token": "Hi", "bytes": [72, 105], "logprob": -0.5, "top_logprobs": []}]
    for url in (CMPL, None):  # a plain body is a completion
        row = completed(url, output(text="Hi", finish="length", logprobs=steps))
        cmpl = parse_exactly(Completion, body(row))
        assert cmpl.object == "text_completion" and cmpl.choices[0].text == "Hi"
        assert cmpl.choices[0].finish_reason == "length" and cmpl.choices[0].logprobs.tokens == ["Hi"]
        assert cmpl.usage.prompt_tokens_details.cached_tokens == 8
        assert cmpl.system_fingerprint.startswith("fp_")


def test_embeddings_parse_in_floats_and_base64():
    vectors = [np.arange(4, dtype=np.float32) / 4, np.ones(4, dtype=np.float32)]
    row = {"job_id": "j", "request_id": "j:0", "idx": 0, "custom_id": "e0", "model": "minilm",
           "status": "completed", "prompt_tokens": 6, "url": EMB,
           "embeddings": [encode_vector(v) for v in vectors], "pooling_params": {}}
    emb = parse_exactly(CreateEmbeddingResponse, body(row))
    assert [d.embedding for d in emb.data] == [v.tolist() for v in vectors]
    assert (emb.usage.prompt_tokens, emb.usage.total_tokens) == (6, 6)
    b64 = body({**row, "pooling_params": {"encoding_format": "base64"}})
    assert [d["embedding"] for d in b64["data"]] == row["embeddings"]


# -- /v1/responses ---------------------------------------------------------------------------------


def test_responses_text():
    resp = parse_exactly(Response, body(completed(RESP)))
    assert resp.object == "response" and re.fullmatch(r"resp_[0-9a-f]{32}", resp.id)
    assert resp.status == "completed" and resp.incomplete_details is None
    assert resp.output_text == "Hello there"
    (message,) = resp.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert re.fullmatch(r"msg_[0-9a-f]{32}", message.id)
    assert [(c.type, c.text, c.annotations) for c in message.content] == [("output_text", "Hello there", [])]
    usage = resp.usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (12, 3, 15)
    assert usage.input_tokens_details.cached_tokens == 8 and usage.output_tokens_details.reasoning_tokens == 0
    assert (resp.created_at, resp.completed_at) == (1_700_000_000, 1_700_000_002)
    assert (resp.temperature, resp.top_p, resp.max_output_tokens) == (0.7, 0.9, 16)
    assert resp.metadata == {"team": "a"} and resp.tools == [] and resp.tool_choice == "auto"


def test_responses_function_calls():
    row = completed(RESP, output(text="", finish="tool_calls", calls=[WEATHER, TIME]))
    resp = parse_exactly(Response, body(row))
    assert [item.type for item in resp.output] == ["function_call", "function_call"]  # no empty message
    first = resp.output[0]
    assert (first.call_id, first.name, first.arguments, first.status) == (
        WEATHER["id"], "get_weather", WEATHER["function"]["arguments"], "completed")
    assert re.fullmatch(r"fc_[0-9a-f]{32}", first.id) and first.id != resp.output[1].id
    mixed = parse_exactly(Response, body(completed(RESP, output(text="Checking.", finish="tool_calls",
                                                                       calls=[WEATHER]))))
    assert [item.type for item in mixed.output] == ["message", "function_call"]
    # the request's tools, when the row carries them (ToolSpec.to_dict())
    spec = {"tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                                        "parameters": {"type": "object", "properties": {}}}}],
            "choice": "function", "function": "get_weather", "parallel": False}
    named = parse_exactly(Response, body(completed(RESP, output(calls=[WEATHER]), tools=spec)))
    assert [(t.type, t.name, t.description) for t in named.tools] == [("function", "get_weather", "Weather.")]
    assert named.tool_choice.name == "get_weather" and named.parallel_tool_calls is False


def test_responses_cut_by_max_output_tokens_are_incomplete():
    resp = parse_exactly(Response, body(completed(RESP, output(text="Once upon", finish="length"))))
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output[0].status == "incomplete" and resp.output_text == "Once upon"
    assert resp.completed_at is None


# -- errors and ids --------------------------------------------------------------------------------


def test_error_lines():
    got = [line(failed()), line(failed("cancelled", None, "the job was cancelled")),
           line(failed("expired", None, "the job expired")), line(failed(url=RESP))]
    assert all(g["response"] is None and set(g) == {"id", "custom_id", "response", "error"} for g in got)
    assert [g["error"]["code"] for g in got] == ["invalid_request", "batch_cancelled", "batch_expired",
                                                 "invalid_request"]
    assert got[0]["error"] == {"code": "invalid_request", "message": "line 4: temperature: bad", "line": 4}


def test_ids_are_opaque_stable_and_distinct():
    first, again = line(completed(CHAT)), line(completed(CHAT))
    other = line(completed(CHAT, request_id="job-1:1"))
    assert re.fullmatch(r"batch_req_[0-9a-f]{32}", first["id"]) and ":" not in json.dumps(
        [first["id"], first["response"]["request_id"], first["response"]["body"]["id"]])
    assert first["id"] == f"batch_req_{first['response']['request_id']}"
    assert first["id"] == again["id"] and first["response"]["body"]["id"] == again["response"]["body"]["id"]
    assert other["id"] != first["id"] and other["response"]["body"]["id"] != first["response"]["body"]["id"]
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", first["response"]["body"]["id"])
    assert line(failed())["id"].startswith("batch_req_") and ":" not in line(failed())["id"]
