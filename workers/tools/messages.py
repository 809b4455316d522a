"""``template_messages``: an OpenAI conversation as chat templates want it.

OpenAI sends an assistant turn's ``tool_calls[].function.arguments`` as a JSON string; templates
render them with ``tojson`` or iterate over them (Llama 3, Qwen 2.5, Mistral), so, as vLLM does,
they get the parsed object. Everything else passes through unchanged (a copy: the request is not
modified).
"""

from __future__ import annotations

import copy
import json
from typing import Any


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A copy of ``messages`` with every assistant tool call's ``arguments`` a JSON object.

    ``ValueError`` naming the path (``messages[3].tool_calls[0].function.arguments: ...``) when an
    ``arguments`` string is not a JSON object."""
    out = copy.deepcopy(messages)
    for i, message in enumerate(out):
        if not isinstance(message, dict) or message.get("role") != "assistant":
            continue
        calls = message.get("tool_calls")
        if not isinstance(calls, list):
            continue
        for j, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
                continue
            path = f"messages[{i}].tool_calls[{j}].function.arguments"
            try:
                args = json.loads(fn["arguments"]) if fn["arguments"].strip() else {}
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: not valid JSON ({e})") from None
            if not isinstance(args, dict):
                raise ValueError(f"{path}: must be a JSON object, got {type(args).__name__}")
            fn["arguments"] = args
    return out
