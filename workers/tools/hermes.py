"""The ``hermes`` format (Hermes 2 Pro, Qwen 2.5 / 3 and their fine-tunes): each call is a JSON
object in ``<tool_call>...</tool_call>``; the content is the text before the first block.

    I'll look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The last block may lack its closing tag (generation stopped on the end-of-turn token right after
the JSON). Text between or after the blocks is dropped, as vLLM does.
"""

from __future__ import annotations

from batchinfer.workers.tools.parsed import (
    MalformedToolCall,
    Parsed,
    call_from_object,
    content_or_none,
    loads,
)

START, END = "<tool_call>", "</tool_call>"


def parse(text: str) -> Parsed | None:
    """The calls in ``text``; None when it has no ``<tool_call>``."""
    first = text.find(START)
    if first < 0:
        return None
    calls = []
    pos = first
    while pos >= 0:
        body_start = pos + len(START)
        end = text.find(END, body_start)
        body = text[body_start:] if end < 0 else text[body_start:end]
        if START in body:
            raise MalformedToolCall("a <tool_call> block opens before the previous one closes")
        calls.append(call_from_object(loads(body), ("arguments", "parameters")))
        pos = -1 if end < 0 else text.find(START, end + len(END))
    return content_or_none(text[:first]), calls
