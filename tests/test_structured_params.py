"""``StructuredOutputsParams`` and ``StructuredLimits``: validation (each error names its field), the
wire round trip, the canonical cache key, and the size / depth / choice limits."""

from __future__ import annotations

import json

import pytest

from batchinfer.workers.structured_params import KINDS, StructuredLimits, StructuredOutputsParams

P = StructuredOutputsParams
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
          "required": ["a"]}


def nested(depth: int) -> dict:
    """A schema whose objects nest ``depth`` levels below the root (as ``_depth`` counts them)."""
    schema: dict = {"type": "integer"}
    for _ in range(depth // 2):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


# -- construction and validation -----------------------------------------------------------------

@pytest.mark.parametrize("kwargs, kind, spec", [
    ({"json": SCHEMA}, "json", SCHEMA),
    ({"json": json.dumps(SCHEMA)}, "json", SCHEMA),  # JSON text is parsed
    ({"json": True}, "json", True),
    ({"json": {}}, "json", {}),  # the empty schema (any value) is a schema, not "not given"
    ({"regex": "[0-9]+"}, "regex", "[0-9]+"),
    ({"choice": ["yes", "no"]}, "choice", ("yes", "no")),
    ({"grammar": 'start: "a"'}, "grammar", 'start: "a"'),
    ({"json_object": True}, "json_object", True),
    ({"regex": "a", "json_object": False}, "regex", "a"),  # json_object=False is "off"
])
def test_kind_and_spec(kwargs, kind, spec):
    p = P(**kwargs)
    assert p.kind == kind
    assert p.spec == spec
    assert p.disable_any_whitespace is True and p.disable_additional_properties is False


@pytest.mark.parametrize("kwargs, field, words", [
    ({}, "structured_outputs", "got none"),
    ({"json_object": False}, "structured_outputs", "got none"),
    ({"json": SCHEMA, "regex": "a"}, "structured_outputs", "got json, regex"),
    ({"json": "{not json"}, "json", "not valid JSON"),
    ({"json": "[" * 200_000}, "json", "too deeply"),
    ({"json": [1, 2]}, "json", "got list"),
    ({"json": 0}, "json", "got int"),
    ({"json": False}, "json", "matches no value"),
    ({"json": "false"}, "json", "matches no value"),
    ({"regex": ""}, "regex", "non-empty string"),
    ({"regex": 5}, "regex", "non-empty string"),
    ({"grammar": ""}, "grammar", "non-empty string"),
    ({"choice": []}, "choice", "non-empty list"),
    ({"choice": "yes"}, "choice", "non-empty list"),
    ({"choice": ["yes", ""]}, "choice[1]", "non-empty string"),
    ({"choice": ["yes", 3]}, "choice[1]", "non-empty string"),
    ({"json_object": "yes"}, "json_object", "boolean"),
    ({"json_object": 1}, "json_object", "boolean"),
    ({"regex": "a", "disable_any_whitespace": "no"}, "disable_any_whitespace", "boolean"),
    ({"regex": "a", "disable_additional_properties": 1}, "disable_additional_properties", "boolean"),
])
def test_errors_name_the_field(kwargs, field, words):
    with pytest.raises(ValueError) as e:
        P(**kwargs)
    message = str(e.value)
    assert message.startswith(field), message
    assert words in message, message


def test_from_dict_rejects_unknown_keys_and_non_objects():
    with pytest.raises(ValueError, match=r"^structured_outputs\.schema is not a structured-outputs field"):
        P.from_dict({"json": SCHEMA, "schema": SCHEMA})
    with pytest.raises(ValueError, match=r"^structured_outputs must be an object, got list"):
        P.from_dict(["json"])  # type: ignore[arg-type]
    p = P(regex="a")
    assert P.from_dict(p) is p  # already params: passed through


def test_from_dict_ignores_none_values():
    """Clients send every field with null for the unused ones."""
    p = P.from_dict({"json": None, "regex": "x+", "choice": None, "grammar": None, "json_object": None,
                     "disable_any_whitespace": None})
    assert p.kind == "regex" and p.disable_any_whitespace is True


# -- round trip and key --------------------------------------------------------------------------

@pytest.mark.parametrize("p", [
    P(json=SCHEMA), P(json=SCHEMA, disable_any_whitespace=False, disable_additional_properties=True),
    P(json=True), P(regex="[a-z]{2,5}"), P(choice=("a", "b\"c", "é")), P(grammar='root ::= "a" | "b"'),
    P(json_object=True),
], ids=lambda p: p.kind)
def test_round_trip_through_json(p):
    d = p.to_dict()
    assert set(d) == {p.kind, "disable_any_whitespace", "disable_additional_properties"}
    wire = json.loads(json.dumps(d))  # what crosses Redis
    back = P.from_dict(wire)
    assert back == p
    assert back.key() == p.key()


def test_to_dict_does_not_share_the_schema():
    p = P(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    p.to_dict()["json"]["properties"]["a"]["type"] = "string"
    assert p.spec["properties"]["a"]["type"] == "integer"


def test_key_is_canonical():
    a = P(json={"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}})
    b = P(json='{"properties": {"b": {"type": "string"}, "a": {"type": "integer"}}, "type": "object"}')
    assert a.key() == b.key()  # key order and JSON text vs dict do not matter
    assert a.key() == json.dumps(json.loads(a.key()), sort_keys=True, separators=(",", ":"))
    assert a.key() != P(json=a.spec, disable_any_whitespace=False).key()  # the options are in the key
    assert a.key() != P(json=a.spec, disable_additional_properties=True).key()
    assert P(choice=["x", "y"]).key() == P(choice=("x", "y")).key()
    assert P(choice=["x", "y"]).key() != P(choice=["y", "x"]).key()  # order: which comes first
    assert P(regex="a").key() != P(grammar="a").key()  # the kind is in the key
    escaped = P(json='{"type":"string","pattern":"\\u00e9"}')
    assert P(json={"type": "string", "pattern": "é"}).key() == escaped.key()


def test_params_are_hashable_and_frozen():
    p = P(choice=["a", "b"])
    assert isinstance(p.choice, tuple)
    with pytest.raises(AttributeError):
        p.regex = "x"  # type: ignore[misc]


# -- limits --------------------------------------------------------------------------------------

def test_limits_validation():
    StructuredLimits(max_spec_bytes=1, max_depth=1, max_choices=1, compile_timeout_s=0.001)
    for name, bad in [("max_spec_bytes", 0), ("max_depth", -1), ("max_choices", 1.5), ("max_depth", True),
                      ("compile_timeout_s", 0), ("compile_timeout_s", float("nan")),
                      ("compile_timeout_s", "5")]:
        with pytest.raises(ValueError, match=f"^{name} must be a positive"):
            StructuredLimits(**{name: bad})


def test_size_limit_names_the_kind_and_the_sizes():
    limits = StructuredLimits(max_spec_bytes=100)
    P(regex="a" * 98).check_limits(limits)  # 98 characters + 2 quotes: exactly the limit
    with pytest.raises(ValueError, match=r"^regex: the regex is 101 bytes; the limit is 100$"):
        P(regex="a" * 99).check_limits(limits)
    with pytest.raises(ValueError, match=r"^choice: the choice is \d+ bytes; the limit is 100$"):
        P(choice=[f"option {i}" for i in range(20)]).check_limits(limits)
    big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(10)}}
    with pytest.raises(ValueError, match=r"^json: the json is \d+ bytes; the limit is 100$"):
        P(json=big).check_limits(limits)
    with pytest.raises(ValueError, match="^grammar: the grammar is"):
        P(grammar="start: " + " | ".join(f'"{i}"' for i in range(40))).check_limits(limits)
    with pytest.raises(ValueError, match="bytes"):  # UTF-8 bytes, not characters
        P(regex="é" * 50).check_limits(limits)


def test_depth_limit():
    limits = StructuredLimits(max_depth=8)
    P(json=nested(8)).check_limits(limits)
    with pytest.raises(ValueError, match=r"^json: the schema nests deeper than 8 levels$"):
        P(json=nested(10)).check_limits(limits)
    # Far past the limit (and past what json.dumps could serialise): rejected, not a RecursionError.
    deep: dict = {}
    for _ in range(100_000):
        deep = {"items": deep}
    with pytest.raises(ValueError, match="nests deeper than 8"):
        P(json=deep).check_limits(limits)
    with pytest.raises(ValueError, match="nests deeper than 32"):
        P(json=deep).check_limits(StructuredLimits())


def test_choice_limit():
    limits = StructuredLimits(max_choices=3)
    P(choice=["a", "b", "c"]).check_limits(limits)
    with pytest.raises(ValueError, match=r"^choice: 4 choices; the limit is 3$"):
        P(choice=["a", "b", "c", "d"]).check_limits(limits)


def test_kinds_are_the_vllm_names():
    assert KINDS == ("json", "regex", "choice", "grammar", "json_object")
    assert set(P.FIELDS) == {*KINDS, "disable_any_whitespace", "disable_additional_properties"}
