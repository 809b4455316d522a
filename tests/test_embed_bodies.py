"""Embeddings bodies (issue 14): ``/v1/embeddings`` OpenAI Batch lines and plain bodies with
``input`` become an ``embed`` RequestSpec; every bad input is an ``invalid_request`` naming the
field, the index and the line. Pure: no Redis, no model (the model's checks are the intake's:
tests/test_embed_intake.py)."""

from __future__ import annotations

import json

import pytest

from batchinfer.protocol.bodies import parse_body
from batchinfer.protocol.entries import MAX_EMBED_INPUTS, RequestError
from batchinfer.workers.pooling_params import PoolingParams


def openai_line(body: dict, custom_id: str = "e-1") -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings", "body": body}


def error_of(body, line: int = 7) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse_body(json.dumps(body), line=line)
    return info.value


def test_an_openai_embeddings_line_maps_onto_an_embed_spec():
    spec = parse_body(json.dumps(openai_line({"model": "minilm", "input": ["a cat", "a dog"],
                                              "encoding_format": "base64", "dimensions": 32,
                                              "user": "someone"})), line=3)
    assert spec.task == "embed" and spec.url == "/v1/embeddings" and spec.custom_id == "e-1"
    assert spec.model == "minilm" and spec.inputs == ["a cat", "a dog"]
    assert spec.pooling_params == PoolingParams(dimensions=32, encoding_format="base64")
    assert spec.prompt is None and spec.messages is None and spec.prompt_token_ids is None


@pytest.mark.parametrize(("given", "inputs"), [
    ("one text", ["one text"]),
    (["a", "b", "c"], ["a", "b", "c"]),
    ([5, 6, 7], [[5, 6, 7]]),  # a list of token ids is ONE input
    ([[5, 6], [7]], [[5, 6], [7]]),
])
def test_every_openai_input_form_gives_one_input_per_vector(given, inputs):
    spec = parse_body({"input": given})
    assert spec.task == "embed" and spec.inputs == inputs and spec.url is None


def test_a_plain_body_takes_vllm_pooling_fields():
    spec = parse_body({"input": "x", "model": "m", "pooling_type": "CLS", "normalize": False,
                       "truncate_prompt_tokens": 16, "dimensions": 8, "priority": 3,
                       "metadata": {"k": "v"}, "custom_id": "c"})
    assert spec.pooling_params == PoolingParams(dimensions=8, normalize=False, pooling_type="cls",
                                                truncate_prompt_tokens=16)
    assert (spec.priority, spec.metadata, spec.custom_id) == (3, {"k": "v"}, "c")
    assert spec.pooling_params.to_dict()["encoding_format"] == "float"  # the default


def test_generation_bodies_are_unchanged_by_the_embeddings_path():
    spec = parse_body({"prompt": "hi", "max_tokens": 3})
    assert spec.task == "generate" and spec.inputs is None and spec.pooling_params is None
    assert spec.sampling_params.max_tokens == 3


BAD = [
    # (body, field, words of the message)
    ({"input": ""}, "input", ["input must not be an empty string"]),
    ({"input": []}, "input", ["input must not be an empty list"]),
    ({"input": ["ok", ""]}, "input[1]", ["input[1] must not be an empty string"]),
    ({"input": [[1, 2], []]}, "input[1]", ["input[1] must be a non-empty list of token ids"]),
    ({"input": None}, "input", ["input must be a string, a list of strings"]),
    ({"input": 42}, "input", ["input must be a string", "42"]),
    ({"input": {"text": "x"}}, "input", ["input must be a string"]),
    ({"input": [1.5]}, "input[0]", ["input[0] must be a string, a token id or a list of token ids", "1.5"]),
    ({"input": [True]}, "input[0]", ["input[0]", "True"]),
    ({"input": ["a", None]}, "input[1]", ["input[1] must be a string", "None"]),
    ({"input": ["a", 3]}, "input[1]", ["input[1] must be a string", "mixes kinds"]),
    ({"input": [3, "a"]}, "input[1]", ["input[1] must be a token id", "'a'"]),
    ({"input": [[3], "a"]}, "input[1]", ["input[1] must be a list of token ids", "mixes kinds"]),
    ({"input": [[3, -1]]}, "input[0][1]", ["input[0][1] must be a token id (integer >= 0)", "-1"]),
    ({"input": [[3, "x"]]}, "input[0][1]", ["input[0][1] must be a token id"]),
    ({"input": [2**40]}, "input[0]", ["input[0] must be a token id"]),
    ({"input": ["t"] * (MAX_EMBED_INPUTS + 1)}, "input",
     [f"input has {MAX_EMBED_INPUTS + 1} elements", f"limit of {MAX_EMBED_INPUTS}"]),
    ({"input": "x", "dimensions": 0}, "dimensions", ["dimensions must be a positive integer", "0"]),
    ({"input": "x", "dimensions": -4}, "dimensions", ["dimensions must be a positive integer"]),
    ({"input": "x", "dimensions": "8"}, "dimensions", ["dimensions must be a positive integer", "'8'"]),
    ({"input": "x", "dimensions": 2.5}, "dimensions", ["dimensions must be a positive integer"]),
    ({"input": "x", "encoding_format": "hex"}, "encoding_format", ["encoding_format must be one of"]),
    ({"input": "x", "pooling_type": "max"}, "pooling_type", ["pooling_type must be one of mean, cls, last"]),
    ({"input": "x", "normalize": "yes"}, "normalize", ["normalize must be true or false"]),
    ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens",
     ["truncate_prompt_tokens must be a positive integer"]),
    # sampling fields are rejected by name, not ignored
    ({"input": "x", "max_tokens": 4}, "max_tokens", ["max_tokens is a sampling parameter", "takes none"]),
    ({"input": "x", "temperature": 0}, "temperature", ["temperature is a sampling parameter"]),
    ({"input": "x", "max_completion_tokens": 4}, "max_completion_tokens", ["is a sampling parameter"]),
    ({"input": "x", "stream": True}, "stream", ["stream: true is not supported"]),
    # input beside a generation input
    ({"input": "x", "prompt": "y"}, "prompt", ["give either input", "or prompt", "not both"]),
    ({"input": "x", "messages": [{"role": "user", "content": "y"}]}, "messages", ["or messages"]),
    ({"input": "x", "prompt_token_ids": [1]}, "prompt_token_ids", ["or prompt_token_ids"]),
    ({"input": "x", "colour": "red"}, "colour", ["unknown field(s)", "colour"]),
]


@pytest.mark.parametrize(("body", "field", "says"), BAD, ids=[f"{i}-{b[1]}" for i, b in enumerate(BAD)])
def test_bad_plain_bodies_name_field_index_and_line(body, field, says):
    e = error_of(body)
    assert (e.code, e.field, e.line) == ("invalid_request", field, 7), e
    for words in says:
        assert words in e.message, (words, e.message)


@pytest.mark.parametrize(("body", "field", "says"), BAD, ids=[f"{i}-{b[1]}" for i, b in enumerate(BAD)])
def test_the_same_bad_inputs_in_openai_lines_keep_their_custom_id(body, field, says):
    e = error_of(openai_line({"model": "m", **body}, custom_id="mine"))
    assert e.code == "invalid_request" and e.field == field and e.line == 7
    assert e.context.get("custom_id") == "mine"  # so the error row still names the caller's id
    assert all(words in e.message for words in says), e.message


def test_openai_lines_need_input_and_keep_endpoints_apart():
    e = error_of(openai_line({"model": "m", "prompt": "x"}))
    assert (e.field, e.message) == ("body.input", "/v1/embeddings needs 'input'")
    chat = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "input": "x"}}
    e = error_of(chat)
    assert e.field == "body.input" and "input is for /v1/embeddings" in e.message
    other = {"custom_id": "c", "method": "POST", "url": "/v1/moderations", "body": {"input": "x"}}
    e = error_of(other)
    assert e.code == "unsupported_url" and "/v1/embeddings" in e.message


def test_the_input_limit_is_inclusive():
    assert len(parse_body({"input": ["t"] * MAX_EMBED_INPUTS}).inputs or []) == MAX_EMBED_INPUTS
