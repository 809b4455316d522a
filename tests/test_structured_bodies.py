"""Structured-output request fields (issue 13): OpenAI ``response_format``, vLLM ``structured_outputs``
and the older ``guided_*`` names map onto one ``StructuredOutputsParams``; every bad form is an
``invalid_request`` naming its exact field and the line; two forms at once name both; embeddings
refuse them. Then the scheduler's check (``StructuredCheck``): limits and compiles with llguidance
for the model's tokenizer, once per spec.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchinfer.config import Settings
from batchinfer.ops.startup import StartupError
from batchinfer.protocol.batches import encode_request
from batchinfer.protocol.bodies import parse_body
from batchinfer.protocol.entries import RequestError
from batchinfer.protocol.rows import BatchRequest
from batchinfer.scheduler.intake import params_dict
from batchinfer.scheduler.lookups import ServedModel
from batchinfer.scheduler.structured_check import StructuredCheck
from batchinfer.store.registry import ModelInfo
from batchinfer.workers.sampling_params import SamplingParams
from batchinfer.workers.structured_params import StructuredOutputsParams as SOP

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**body) -> dict:
    return {"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "gpt-4o-mini", "messages": MESSAGES, **body}}


def completion(**body) -> dict:
    return {"custom_id": "c2", "method": "POST", "url": "/v1/completions",
            "body": {"model": "m", "prompt": "Hello", **body}}


def plain(**body) -> dict:
    return {"prompt": "Hello", **body}


def schema_format(schema=SCHEMA, **extra) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, **extra}}


def error_of(body, line: int = 7) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse_body(body, line=line)
    return info.value


# -- accepted forms ---------------------------------------------------------------------------------

GOOD = [
    # OpenAI response_format, on chat and completions lines and plain bodies
    (chat(response_format=schema_format(strict=True)),
     SOP(json=SCHEMA, disable_additional_properties=True), "response_format.json_schema.schema"),
    (chat(response_format=schema_format(strict=False, description="d")), SOP(json=SCHEMA),
     "response_format.json_schema.schema"),
    (chat(response_format=schema_format(strict=None)), SOP(json=SCHEMA),
     "response_format.json_schema.schema"),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "any_object"}}),
     SOP(json_object=True), "response_format.json_schema"),  # no schema: any JSON object, as OpenAI
    (chat(response_format={"type": "json_object"}), SOP(json_object=True), "response_format"),
    (completion(response_format=schema_format(strict=True)),
     SOP(json=SCHEMA, disable_additional_properties=True), "response_format.json_schema.schema"),
    (plain(response_format={"type": "json_object"}), SOP(json_object=True), "response_format"),
    # vLLM structured_outputs
    (plain(structured_outputs={"json": SCHEMA}), SOP(json=SCHEMA), "structured_outputs.json"),
    (plain(structured_outputs={"json": json.dumps(SCHEMA)}), SOP(json=SCHEMA), "structured_outputs.json"),
    (plain(structured_outputs={"regex": "[a-z]{3}"}), SOP(regex="[a-z]{3}"), "structured_outputs.regex"),
    (chat(structured_outputs={"choice": ["yes", "no"]}), SOP(choice=("yes", "no")),
     "structured_outputs.choice"),
    (plain(structured_outputs={"grammar": 'root ::= "a"'}), SOP(grammar='root ::= "a"'),
     "structured_outputs.grammar"),
    (plain(structured_outputs={"json_object": True}), SOP(json_object=True),
     "structured_outputs.json_object"),
    (plain(structured_outputs={"json": SCHEMA, "disable_any_whitespace": False,
                               "disable_additional_properties": True, "disable_fallback": True}),
     SOP(json=SCHEMA, disable_any_whitespace=False, disable_additional_properties=True),
     "structured_outputs.json"),
    # vLLM's older guided_* names
    (completion(guided_json=SCHEMA), SOP(json=SCHEMA), "guided_json"),
    (plain(guided_json=json.dumps(SCHEMA)), SOP(json=SCHEMA), "guided_json"),
    (plain(guided_regex=r"\d+"), SOP(regex=r"\d+"), "guided_regex"),
    (chat(guided_choice=["a", "b"]), SOP(choice=("a", "b")), "guided_choice"),
    (plain(guided_grammar='start: "x"'), SOP(grammar='start: "x"'), "guided_grammar"),
    (plain(guided_json=SCHEMA, guided_decoding_backend="xgrammar"), SOP(json=SCHEMA), "guided_json"),
    (plain(guided_json=SCHEMA, guided_decoding_backend="guidance:disable-additional-properties,no-fallback"),
     SOP(json=SCHEMA, disable_additional_properties=True), "guided_json"),
    # type "text" constrains nothing, so it does not conflict with a guided_* field
    (chat(response_format={"type": "text"}, guided_regex="x+"), SOP(regex="x+"), "guided_regex"),
]


@pytest.mark.parametrize("body,want,field", GOOD, ids=[f"{i}-{g[2]}" for i, g in enumerate(GOOD)])
def test_every_accepted_form_maps_to_its_structured_outputs_params(body, want, field):
    spec = parse_body(body, line=3)
    assert spec.sampling_params.structured_outputs == want
    assert spec.structured_field == field
    # it rides the batch wire inside sampling_params and comes back equal on the worker
    request = BatchRequest("r", None, None, [1, 2], params_dict(spec.sampling_params), "m")
    wire = json.loads(encode_request(request))["sampling_params"]
    assert SamplingParams.from_dict(wire).structured_outputs == want


@pytest.mark.parametrize("body", [chat(response_format={"type": "text"}), chat(response_format=None),
                                  plain(guided_json=None, structured_outputs=None),
                                  plain(guided_decoding_backend="auto")])
def test_no_constraint(body):
    spec = parse_body(body)
    assert spec.sampling_params.structured_outputs is None and spec.structured_field is None


# -- bad forms: code, exact field path, the message, the line ---------------------------------------

BAD = [
    (chat(response_format="json"), "response_format", ["response_format must be an object"]),
    (chat(response_format={"type": "xml"}), "response_format.type",
     ["one of text, json_object, json_schema"]),
    (chat(response_format={}), "response_format.type", ["got None"]),
    (chat(response_format={"type": "json_object", "schema": SCHEMA}), "response_format.schema",
     ["response_format.schema is not a field", "'json_object'"]),
    (chat(response_format={"type": "json_schema"}), "response_format.json_schema",
     ["response_format.json_schema must be an object"]),
    (chat(response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}}),
     "response_format.json_schema.name", ["name is missing", "OpenAI requires a name"]),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "has space", "schema": SCHEMA}}),
     "response_format.json_schema.name", ["1 to 64 letters"]),
    (chat(response_format=schema_format(strict="yes")), "response_format.json_schema.strict",
     ["strict must be a boolean"]),
    (chat(response_format=schema_format(description=3)), "response_format.json_schema.description",
     ["description must be a string"]),
    (chat(response_format=schema_format(extra=1)), "response_format.json_schema.extra",
     ["not a json_schema field"]),
    (chat(response_format=schema_format(schema=[1])), "response_format.json_schema.schema",
     ["response_format.json_schema.schema must be a JSON schema (an object), got list"]),
    (chat(response_format=schema_format(schema=False)), "response_format.json_schema.schema",
     ["matches no value"]),
    (plain(structured_outputs=["regex"]), "structured_outputs", ["structured_outputs must be an object"]),
    (plain(structured_outputs={}), "structured_outputs", ["give exactly one of json, regex", "got none"]),
    (plain(structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs",
     ["give exactly one", "got regex, choice"]),
    (plain(structured_outputs={"regex": ""}), "structured_outputs.regex",
     ["structured_outputs.regex must be a non-empty string"]),
    (plain(structured_outputs={"choice": []}), "structured_outputs.choice",
     ["structured_outputs.choice must be a non-empty list"]),
    (plain(structured_outputs={"choice": ["a", 3]}), "structured_outputs.choice[1]",
     ["structured_outputs.choice[1] must be a non-empty string"]),
    (plain(structured_outputs={"json": "{not json"}), "structured_outputs.json",
     ["structured_outputs.json: the schema is not valid JSON"]),
    (plain(structured_outputs={"json_object": "yes"}), "structured_outputs.json_object",
     ["json_object must be a boolean"]),
    (plain(structured_outputs={"regex": "a", "disable_any_whitespace": 1}),
     "structured_outputs.disable_any_whitespace", ["disable_any_whitespace must be a boolean"]),
    (plain(structured_outputs={"regex": "a", "bogus": 1}), "structured_outputs.bogus",
     ["structured_outputs.bogus is not a structured-outputs field"]),
    (plain(structured_outputs={"json": SCHEMA, "whitespace_pattern": " "}),
     "structured_outputs.whitespace_pattern",
     ["not supported"]),
    (plain(structured_outputs={"structural_tag": "{}"}), "structured_outputs.structural_tag",
     ["not supported"]),
    (plain(structured_outputs={"regex": "a", "disable_fallback": "no"}),
     "structured_outputs.disable_fallback",
     ["must be a boolean"]),
    (plain(guided_json=[1]), "guided_json", ["guided_json must be a JSON schema (an object)"]),
    (plain(guided_json="{"), "guided_json", ["guided_json: the schema is not valid JSON"]),
    (plain(guided_regex=""), "guided_regex", ["guided_regex must be a non-empty string"]),
    (plain(guided_regex=5), "guided_regex", ["guided_regex must be a non-empty string"]),
    (plain(guided_choice="a"), "guided_choice", ["guided_choice must be a non-empty list of strings"]),
    (plain(guided_choice=[]), "guided_choice", ["guided_choice must be a non-empty list"]),
    (plain(guided_choice=["a", ""]), "guided_choice[1]", ["guided_choice[1] must be a non-empty string"]),
    (plain(guided_grammar=""), "guided_grammar", ["guided_grammar must be a non-empty string"]),
    (plain(guided_json=SCHEMA, guided_decoding_backend="outlines"), "guided_decoding_backend",
     ["'outlines' is not available", "llguidance"]),
    (plain(guided_json=SCHEMA, guided_decoding_backend="xgrammar:fast"), "guided_decoding_backend",
     ["option 'fast' is not supported"]),
    (plain(guided_json=SCHEMA, guided_decoding_backend=1), "guided_decoding_backend", ["must be a string"]),
    (plain(guided_json=SCHEMA, guided_whitespace_pattern=r"[ ]?"), "guided_whitespace_pattern",
     ["not supported", "disable_any_whitespace: false"]),
]


@pytest.mark.parametrize("body,field,words", BAD, ids=[f"{i}-{b[1]}" for i, b in enumerate(BAD)])
def test_every_bad_form_names_its_field_and_line(body, field, words):
    err = error_of(body, line=42)
    assert (err.code, err.field, err.line) == ("invalid_request", field, 42)
    text = str(err)
    assert text.startswith("line 42: ")
    for word in words:
        assert word in text, (word, text)


TWO = [
    (chat(response_format={"type": "json_object"}, structured_outputs={"regex": "a"}),
     "response_format", "structured_outputs"),
    (plain(guided_json=SCHEMA, guided_regex="a"), "guided_json", "guided_regex"),
    (plain(structured_outputs={"regex": "a"}, guided_choice=["a"]), "structured_outputs", "guided_choice"),
    (completion(response_format=schema_format(), guided_grammar='start: "a"'), "response_format",
     "guided_grammar"),
]


@pytest.mark.parametrize("body,first,second", TWO, ids=[t[2] for t in TWO])
def test_two_forms_at_once_is_an_error_naming_both(body, first, second):
    err = error_of(body)
    assert (err.code, err.field) == ("invalid_request", second)
    assert f"{first} and {second} both constrain the output" in str(err)


EMBED_BODIES = [
    ({"custom_id": "e", "method": "POST", "url": "/v1/embeddings",
      "body": {"input": "x", "response_format": {"type": "json_object"}}}, "response_format",
     "/v1/embeddings"),
    ({"input": "x", "structured_outputs": {"regex": "a"}}, "structured_outputs", "an embeddings request"),
    ({"input": "x", "guided_json": SCHEMA}, "guided_json", "an embeddings request"),
    ({"input": "x", "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend",
     "an embeddings request"),
]


@pytest.mark.parametrize("body,field,endpoint", EMBED_BODIES, ids=[e[1] for e in EMBED_BODIES])
def test_embeddings_refuse_the_fields_by_name(body, field, endpoint):
    err = error_of(body)
    assert (err.code, err.field) == ("invalid_request", field)
    assert f"{field} constrains generated text; {endpoint} generates none" in str(err)


def test_a_failed_structured_body_keeps_its_custom_id():
    assert error_of(chat(response_format={"type": "xml"})).context == {"custom_id": "c1"}


# -- the scheduler's check: limits and a compile for the model's tokenizer --------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> ServedModel:
    from batchinfer.workers.models.tiny import make_tiny_model
    from batchinfer.workers.text.tokenizer import Tokenizer

    folder = make_tiny_model(Path(tmp_path_factory.mktemp("models")) / "tiny")
    tokenizer = Tokenizer.from_dir(folder)
    info = ModelInfo("tiny", {}, 512, 8, 512, 4096, eos_token_ids=tokenizer.eos_token_ids, fingerprint="f")
    return ServedModel(info, tokenizer)


def checked(check: StructuredCheck, served: ServedModel, body: dict) -> RequestError | None:
    try:
        check.check(parse_body(body, line=5), served)
    except RequestError as e:
        return e
    return None


def deep(levels: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema, "maxItems": 1}
    return schema


CHECK_BAD = [
    (chat(response_format=schema_format(schema={"type": "objekt"})), "response_format.json_schema.schema",
     ["objekt"]),
    (chat(response_format=schema_format(schema={"type": "string", "format": "bogus"})),
     "response_format.json_schema.schema", ["format", "bogus"]),
    (plain(guided_json={"$ref": "#/$defs/missing"}), "guided_json", ["missing"]),
    (plain(structured_outputs={"regex": "[a-z"}), "structured_outputs.regex", ["unclosed character class"]),
    (plain(guided_regex="(ab"), "guided_regex", ["unclosed group"]),
    (plain(guided_grammar='start: "a" | ('), "guided_grammar", ["guided_grammar: "]),
    (plain(guided_grammar="root ::= undefined"), "guided_grammar", ["not a valid EBNF grammar", "undefined"]),
    (plain(guided_grammar="start: x"), "guided_grammar", ["unknown name"]),
    # limits (set low by the fixture's settings): each names the setting that bounds it
    (plain(guided_json=deep(5)), "guided_json", ["nests deeper than 4 levels",
     "BATCHINFER_STRUCTURED_MAX_DEPTH"]),
    (plain(guided_choice=[f"c{i}" for i in range(9)]), "guided_choice",
     ["9 choices; the limit is 8", "BATCHINFER_STRUCTURED_MAX_CHOICES"]),
    (plain(guided_regex="a" * 300), "guided_regex", ["the limit is 256",
     "BATCHINFER_STRUCTURED_MAX_SPEC_BYTES"]),
]


@pytest.mark.parametrize("body,field,words", CHECK_BAD, ids=[f"{i}-{c[1]}" for i, c in enumerate(CHECK_BAD)])
def test_the_scheduler_check_refuses_what_cannot_be_served(served, body, field, words):
    check = StructuredCheck(Settings(structured_max_depth=4, structured_max_choices=8,
                                     structured_max_spec_bytes=256))
    err = checked(check, served, body)
    assert err is not None
    assert (err.code, err.field) == ("invalid_request", field)
    assert err.message.startswith(f"{field}: "), err.message
    for word in words:
        assert word in err.message, (word, err.message)


def test_the_scheduler_check_passes_good_specs_and_compiles_each_once(served):
    check = StructuredCheck(Settings())
    bodies = [chat(response_format=schema_format(strict=True)), plain(guided_regex=r"[0-9]{3}"),
              plain(structured_outputs={"choice": ["yes", "no"]}), plain(guided_grammar='root ::= "a" | "b"'),
              chat(response_format={"type": "json_object"}), plain(guided_json=deep(4))]
    for _ in range(3):  # a job's rows sharing a few specs: one compile per spec, not per row
        for body in bodies:
            assert checked(check, served, body) is None, body
    assert checked(check, served, plain()) is None  # unconstrained: nothing to check
    backends = list(check._backends.values())
    assert len(backends) == 1 and backends[0].num_compiles == len(bodies)


def test_limits_come_from_the_environment_and_a_bad_one_refuses_to_start():
    settings = Settings.from_env({"BATCHINFER_STRUCTURED_MAX_DEPTH": "3",
                                  "BATCHINFER_STRUCTURED_COMPILE_TIMEOUT_S": "0.5"})
    limits = StructuredCheck(settings).limits
    assert (limits.max_depth, limits.compile_timeout_s, limits.max_choices) == (3, 0.5, 1024)
    with pytest.raises(StartupError, match="max_spec_bytes must be a positive integer"):
        StructuredCheck(Settings(structured_max_spec_bytes=0))


# -- specs that compile but fail on their first tokens (issue 27 item 5) ------------------------------

LARK_3000 = "start: " + " | ".join(f'"w{i}"' for i in range(3000)) + "\n"  # ~24 KB, one row of 3,001 items
DFA_HEAVY = "(x{1000}){1000}"  # llguidance: "too many expressions constructed" on its first token

FIRST_TOKENS_BAD = [
    (plain(guided_regex=DFA_HEAVY), "guided_regex",
     ["too many expressions", "BATCHINFER_STRUCTURED_LEXER_FUEL"]),
    (plain(structured_outputs={"regex": DFA_HEAVY}), "structured_outputs.regex", ["too many expressions"]),
    (chat(response_format=schema_format(schema={"type": "string", "pattern": f"^{DFA_HEAVY}$"})),
     "response_format.json_schema.schema", ["too many expressions"]),
    (plain(guided_grammar=LARK_3000), "guided_grammar", ["Current row has 3001 items; max is 2000"]),
    (plain(structured_outputs={"grammar": LARK_3000}), "structured_outputs.grammar", ["3001 items"]),
]


@pytest.mark.parametrize("body,field,words", FIRST_TOKENS_BAD,
                         ids=[f"{i}-{c[1]}" for i, c in enumerate(FIRST_TOKENS_BAD)])
def test_the_scheduler_check_refuses_specs_that_compile_but_fail_on_their_first_tokens(served, body, field,
                                                                                      words):
    check = StructuredCheck(Settings())
    err = checked(check, served, body)
    assert err is not None, "accepted a spec no worker can decode"
    assert (err.code, err.field) == ("invalid_request", field)
    assert err.message.startswith(f"{field}: it fails on its first tokens: "), err.message
    for word in words:
        assert word in err.message, (word, err.message)


def test_the_lexer_fuel_setting_bounds_what_the_check_accepts_and_probes_once_per_spec(served):
    heavy = plain(guided_regex="(x{300}){300}")  # ~50 ms a step per request under llguidance's own fuel
    assert checked(StructuredCheck(Settings(structured_lexer_fuel=1_000_000)), served, heavy) is None
    check = StructuredCheck(Settings())
    assert check.limits.lexer_fuel == 100_000
    err = checked(check, served, heavy)
    assert err is not None and "BATCHINFER_STRUCTURED_LEXER_FUEL" in err.message
    for _ in range(3):  # a job's rows sharing one good spec: one compile and one probe
        assert checked(check, served, plain(guided_regex="x{100}[a-z]{3}")) is None
    backend = next(iter(check._backends.values()))
    assert backend is not None and backend.num_probes == 2 and backend.num_compiles == 2
    settings = Settings.from_env({"BATCHINFER_STRUCTURED_LEXER_FUEL": "5000"})
    assert StructuredCheck(settings).limits.lexer_fuel == 5000


def test_workers_read_the_schedulers_limits_with_their_own_overrides_on_top():
    from batchinfer.workers.structured_params import StructuredLimits, limits_from_settings

    settings = Settings.from_env({"BATCHINFER_STRUCTURED_LEXER_FUEL": "20000",
                                  "BATCHINFER_STRUCTURED_MAX_CHOICES": "9"})
    assert limits_from_settings(settings) == StructuredCheck(settings).limits
    worker = limits_from_settings(settings, {"max_spec_bytes": 4096})  # --engine-option structured_limits=...
    assert (worker.lexer_fuel, worker.max_choices, worker.max_spec_bytes) == (20000, 9, 4096)
    assert limits_from_settings(settings, StructuredLimits()) == StructuredLimits()
    with pytest.raises(ValueError, match="unknown limit.*lexer_fule"):
        limits_from_settings(settings, {"lexer_fule": 1})
    with pytest.raises(ValueError, match="lexer_fuel must be a positive integer"):
        limits_from_settings(Settings(structured_lexer_fuel=0))
