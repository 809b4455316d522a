"""What the output-format tests share: result rows as the worker writes them, and parsing a line
with a vendor SDK's model, exactly.

The ``openai`` / ``anthropic`` packages' pydantic models accept unknown keys and coerce values, so
``parse_exactly`` validates in strict mode, refuses keys the model does not know (at any depth),
and dumps the model back to compare it with the line: every key we write is one the vendor's model
has, with the value we wrote.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel

M = TypeVar("M", bound=BaseModel)


def parse_exactly(model: type[M], data: dict[str, Any]) -> M:
    parsed = model.model_validate(data, strict=True)
    _no_unknown_keys(parsed, "$")
    assert parsed.model_dump(mode="json", exclude_unset=True, by_alias=True) == data
    return parsed


def _no_unknown_keys(value: Any, path: str) -> None:
    if isinstance(value, BaseModel):
        assert not value.model_extra, f"{path}: keys the model does not know: {sorted(value.model_extra)}"
        for name in type(value).model_fields:
            _no_unknown_keys(getattr(value, name), f"{path}.{name}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _no_unknown_keys(item, f"{path}[{i}]")


# -- rows ------------------------------------------------------------------------------------------

CHAT, CMPL, RESP, EMB = "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings"
WEATHER = {"id": "call_Wx1b2c3d4e5f6g7h8i9j0k1l", "type": "function",
           "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
TIME = {"id": "call_Tm1b2c3d4e5f6g7h8i9j0k1l", "type": "function",
        "function": {"name": "get_time", "arguments": '{"tz": "Europe/Paris"}'}}


def output(text: str = "Hello there", finish: str = "stop", calls: list[dict] | None = None, index: int = 0,
           stop_reason: Any = None, logprobs: list[dict] | None = None) -> dict[str, Any]:
    return {"index": index, "text": text, "token_ids": [5, 6, 7], "finish_reason": finish,
            "logprobs": logprobs, "cumulative_logprob": None, "stop_reason": stop_reason,
            "structured": None, "structured_complete": None, "tool_calls": calls}


def completed(url: str | None, *outputs: dict[str, Any], request_id: str = "job-1:0", **fields: Any) -> dict:
    """A completed row as the worker writes it (outputs[i] with their calls, the first's on the row)."""
    outs = list(outputs) or [output()]
    first = outs[0]
    return {"job_id": "job-1", "request_id": request_id, "idx": 0, "custom_id": "req-1",
            "model": "tiny-llama", "status": "completed", "finish_reason": first["finish_reason"],
            "output_text": first["text"],
            "output_token_ids": first["token_ids"], "outputs": outs, "prompt_tokens": 12,
            "completion_tokens": 3 * len(outs), "cached_tokens": 8, "created_at": 1_700_000_000_500,
            "started_at": 1_700_000_001_000, "finished_at": 1_700_000_002_900, "worker": "w1",
            "sampling_params": {"max_tokens": 16, "temperature": 0.7, "top_p": 0.9},
            "metadata": {"team": "a"}, "url": url, "tool_calls": first["tool_calls"], **fields}


def failed(status: str = "failed", code: str | None = "invalid_request", message: str = "temperature: bad",
           **fields: Any) -> dict:
    return {"job_id": "job-1", "request_id": "job-1:3", "idx": 3, "custom_id": "req-3", "status": status,
            "error_code": code, "error_message": message, "line": 4, "url": CHAT, **fields}
