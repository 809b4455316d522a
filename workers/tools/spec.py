"""``ToolSpec`` and ``parse_tools``: a request's ``tools`` / ``tool_choice`` / ``parallel_tool_calls``,
checked by OpenAI's Chat Completions rules, and the JSON schema that constrains a forced call.

Torch- and backend-free (the queue side validates bodies with it). Whether a ``parameters`` schema
compiles is the structured-outputs backend's question: the scheduler compiles ``call_schema()`` with
the model's tokenizer like any other ``structured_outputs``; here it only has to be a JSON object.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import Any

CHOICES = ("none", "auto", "required", "function")
MAX_TOOLS = 128  # OpenAI's limit on `tools`
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_TOOL_KEYS = {"type", "function"}
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolSpec:
    """A request's tools, validated: what travels on the wire (``to_dict``) to the worker.

    ``tools`` are OpenAI function tools as the request gave them; ``choice`` is ``"none"``,
    ``"auto"``, ``"required"`` or ``"function"`` (then ``function`` names the one to call);
    ``parallel`` is ``parallel_tool_calls`` (more than one call allowed)."""

    tools: list[dict[str, Any]] = field(default_factory=list)
    choice: str = "auto"
    function: str | None = None
    parallel: bool = True

    def __post_init__(self) -> None:
        if self.choice not in CHOICES:
            raise ValueError(f"choice must be one of {', '.join(CHOICES)}, got {self.choice!r}")
        if (self.choice == "function") != (self.function is not None):
            raise ValueError("function is set exactly when choice is 'function'")
        if self.function is not None and self.function not in self.names():
            raise ValueError(f"function {self.function!r} is not one of the tools")

    def names(self) -> list[str]:
        """The functions' names, in the tools' order."""
        return [t["function"]["name"] for t in self.tools]

    def parameters(self, name: str) -> dict[str, Any]:
        """The ``parameters`` schema of function ``name`` (an empty object schema when absent)."""
        for t in self.tools:
            if t["function"]["name"] == name:
                return t["function"].get("parameters") or EMPTY_PARAMETERS
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict (``RequestSpec.tools``); ``from_dict`` reads it back."""
        return {"tools": copy.deepcopy(self.tools), "choice": self.choice, "function": self.function,
                "parallel": self.parallel}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ToolSpec:
        """The spec ``to_dict`` wrote (the tools are trusted: ``parse_tools`` checked them)."""
        return cls(tools=copy.deepcopy(list(d["tools"])), choice=d["choice"], function=d.get("function"),
                   parallel=bool(d.get("parallel", True)))

    def template_tools(self) -> list[dict[str, Any]]:
        """The tools as a chat template gets them (transformers' ``apply_chat_template(tools=...)``:
        the OpenAI list as given)."""
        return copy.deepcopy(self.tools)

    def call_constraint(self) -> dict[str, Any] | None:
        """For ``required`` / ``function``: the ``structured_outputs`` that forces the calls, i.e.
        :meth:`call_schema` with every object schema that does not say otherwise closed
        (``disable_additional_properties``: xgrammar's default and OpenAI's ``strict``), so that a
        model cannot pad the arguments with keys its function never declared. None otherwise."""
        schema = self.call_schema()
        return None if schema is None else {"json": schema, "disable_additional_properties": True}

    def call_schema(self) -> dict[str, Any] | None:
        """For ``required`` / ``function``: the JSON schema of the whole output, a list of calls
        ``[{"name": ..., "parameters": {...}}]`` whose ``parameters`` match their function's schema.
        None for ``auto`` / ``none`` (the output is free; a parser finds the calls)."""
        if self.choice not in ("required", "function"):
            return None
        names = [self.function] if self.function is not None else self.names()
        defs: dict[str, Any] = {}
        variants = []
        for i, name in enumerate(names):
            assert name is not None
            params = _object_schema(self.parameters(name))
            if _has_ref(params):
                # `$ref`s point into the function's own schema ("#/$defs/X"); nested under the call
                # list they would point nowhere. Move the schema to the root's $defs and re-anchor them.
                key = f"function_{i}"
                defs[key] = _reanchor(params, f"#/$defs/{key}")
                params = {"$ref": f"#/$defs/{key}"}
            variants.append({"type": "object",
                             "properties": {"name": {"type": "string", "const": name}, "parameters": params},
                             "required": ["name", "parameters"], "additionalProperties": False})
        items = variants[0] if len(variants) == 1 else {"anyOf": variants}
        schema: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
        if not self.parallel or self.choice == "function":
            schema["maxItems"] = 1
        if defs:
            schema["$defs"] = defs
        return schema


def _object_schema(params: dict[str, Any]) -> dict[str, Any]:
    """``params`` with ``"type": "object"`` made explicit: arguments are always an object."""
    out = copy.deepcopy(params)
    out.setdefault("type", "object")
    return out


def _has_ref(node: Any) -> bool:
    if isinstance(node, dict):
        return "$ref" in node or any(_has_ref(v) for v in node.values())
    if isinstance(node, list):
        return any(_has_ref(v) for v in node)
    return False


def _reanchor(node: Any, base: str) -> Any:
    """``node`` with every local ``$ref`` ("#", "#/...") made relative to ``base`` instead of the root."""
    if isinstance(node, dict):
        out = {k: _reanchor(v, base) for k, v in node.items()}
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            out["$ref"] = base + ref[1:]
        return out
    if isinstance(node, list):
        return [_reanchor(v, base) for v in node]
    return node


def parse_tools(tools: Any, tool_choice: Any = None, parallel_tool_calls: Any = None) -> ToolSpec | None:
    """Validate a body's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` (OpenAI's rules).

    None when there are no tools. ``tool_choice`` defaults to ``"auto"``, ``parallel_tool_calls`` to
    true. ``ValueError`` whose message starts with the body path of the bad field
    (``tools[2].function.name: ...``, ``tool_choice: ...``)."""
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise ValueError(f"parallel_tool_calls: must be a boolean, got {parallel_tool_calls!r}")
    if tools is None:
        if tool_choice is not None:
            raise ValueError("tool_choice: is only allowed when tools are given")
        return None
    if not isinstance(tools, list):
        raise ValueError(f"tools: must be a list of function tools, got {type(tools).__name__}")
    if not tools:
        raise ValueError("tools: empty list; give at least one tool or leave the field out")
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"tools: {len(tools)} tools, more than the {MAX_TOOLS} allowed")
    checked = [_check_tool(t, f"tools[{i}]") for i, t in enumerate(tools)]
    names = [t["function"]["name"] for t in checked]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ValueError(f"tools[{i}].function.name: duplicate function name {name!r}")
    choice, function = _check_choice(tool_choice, names)
    return ToolSpec(tools=checked, choice=choice, function=function,
                    parallel=True if parallel_tool_calls is None else parallel_tool_calls)


def _check_tool(tool: Any, path: str) -> dict[str, Any]:
    if not isinstance(tool, dict):
        raise ValueError(f"{path}: must be an object, got {type(tool).__name__}")
    _refuse_unknown(tool, _TOOL_KEYS, path)
    if tool.get("type") != "function":
        raise ValueError(f"{path}.type: must be 'function', got {tool.get('type')!r}")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise ValueError(f"{path}.function: must be an object with a name, got {fn!r}")
    path += ".function"
    _refuse_unknown(fn, _FUNCTION_KEYS, path)
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"{path}.name: must be 1-64 characters of a-z, A-Z, 0-9, '_' and '-', got {name!r}")
    if "description" in fn and not isinstance(fn["description"], str):
        raise ValueError(f"{path}.description: must be a string, got {fn['description']!r}")
    if "strict" in fn and fn["strict"] is not None and not isinstance(fn["strict"], bool):
        raise ValueError(f"{path}.strict: must be a boolean, got {fn['strict']!r}")
    if "parameters" in fn:
        params = fn["parameters"]
        if not isinstance(params, dict):
            raise ValueError(f"{path}.parameters: must be a JSON schema object, got {type(params).__name__}")
        if params.get("type", "object") != "object":
            raise ValueError(f"{path}.parameters: must be a schema of type 'object' (the arguments "
                             f"are an object), got type {params.get('type')!r}")
    return copy.deepcopy(tool)


def _refuse_unknown(given: dict[str, Any], known: set[str], path: str) -> None:
    """ValueError naming ``given``'s keys outside ``known`` (a misspelt ``paramters`` is not dropped)."""
    unknown = sorted(set(given) - known)
    if unknown:
        raise ValueError(f"{path}: unknown field(s) {', '.join(map(str, unknown))}")


def _check_choice(tool_choice: Any, names: list[str]) -> tuple[str, str | None]:
    if tool_choice is None:
        return "auto", None
    if isinstance(tool_choice, str):
        if tool_choice in ("none", "auto", "required"):
            return tool_choice, None
        raise ValueError(f"tool_choice: must be 'none', 'auto', 'required' or "
                         f'{{"type": "function", "function": {{"name": ...}}}}, got {tool_choice!r}')
    if not isinstance(tool_choice, dict):
        raise ValueError(f"tool_choice: must be a string or an object, got {type(tool_choice).__name__}")
    _refuse_unknown(tool_choice, _TOOL_KEYS, "tool_choice")
    if tool_choice.get("type") != "function":
        raise ValueError(f"tool_choice.type: must be 'function', got {tool_choice.get('type')!r}")
    fn = tool_choice.get("function")
    if not isinstance(fn, dict) or "name" not in fn:
        raise ValueError(f"tool_choice.function: must be an object with a name, got {fn!r}")
    name = fn["name"]
    if name not in names:
        raise ValueError(f"tool_choice.function.name: {name!r} is not one of the tools' functions "
                         f"({', '.join(names)})")
    return "function", name
