"""Tool calling (OpenAI ``tools``): the request's tools and choice, the schema that forces a call,
the conversation as a chat template wants it, and the parsers that find calls in a model's text.

``spec`` (``ToolSpec``, ``parse_tools``: the body fields, and ``call_schema``), ``messages``
(``template_messages``), ``parsers`` (the ``auto`` formats by vLLM's names, one module each:
``hermes``, ``llama3_json``, ``mistral``, ``pythonic``, sharing ``parsed``; and
``parser_for_template``) and ``calls`` (``extract_tool_calls``: text -> OpenAI ``tool_calls``).
No torch, Redis or queue imports: the queue side validates bodies with it.
"""

from batchinfer.workers.tools.calls import (
    ToolCallResult,
    ToolParserMissing,
    call_id,
    extract_tool_calls,
    finish_reason_with_tools,
    require_parser,
)
from batchinfer.workers.tools.messages import template_messages
from batchinfer.workers.tools.parsers import NEEDS_SPECIAL_TOKENS, TOOL_PARSERS, parser_for_template
from batchinfer.workers.tools.spec import ToolSpec, parse_tools

__all__ = [
    "NEEDS_SPECIAL_TOKENS",
    "TOOL_PARSERS",
    "ToolCallResult",
    "ToolParserMissing",
    "ToolSpec",
    "call_id",
    "extract_tool_calls",
    "finish_reason_with_tools",
    "parse_tools",
    "parser_for_template",
    "require_parser",
    "template_messages",
]
