"""compact_json.dumps and loads: orjson where it can, the standard library where it cannot, the
same values."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchinfer.protocol import compact_json
from batchinfer.protocol.rows import ResultRow

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text()
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20)


@given(json_values)
def test_dumps_writes_what_json_reads_back_as_the_same_value(value):
    text = compact_json.dumps(value)
    assert json.loads(text) == value
    assert json.loads(text.encode("utf-8")) == value


def test_dumps_is_the_compact_form_of_json_for_a_row_s_values():
    value = {"text": "héllo ✓ \"q\"\n", "ids": [1, 2, 3], "ok": True, "none": None, "p": 0.5,
             "nested": {"a": [{"b": -7}]}}
    assert compact_json.dumps(value) == json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def test_a_float_that_is_not_finite_is_null_never_a_token_json_lacks():
    text = compact_json.dumps({"logprob": -math.inf, "x": math.nan, "y": math.inf})
    assert text == '{"logprob":null,"x":null,"y":null}'
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))


def test_what_orjson_refuses_is_encoded_by_json():
    big = 2**70
    assert compact_json.dumps({"n": big}) == '{"n":' + str(big) + "}"

    class Weird:
        pass

    with pytest.raises(TypeError, match="Weird"):
        compact_json.dumps(Weird())  # neither knows it: json's error, not orjson's
    # a lone surrogate (a producer wrote one straight to a stream): json keeps it; the row escapes it
    assert compact_json.dumps("a\ud800") == '"a\ud800"'
    row = ResultRow(job_id="j", request_id="j:0", status="completed", idx=0, output_text="a\ud800")
    text = row.to_json()
    assert "\\ud800" in text and text.encode("utf-8")
    assert ResultRow.from_json(text).output_text == "a\ud800"


@pytest.mark.parametrize("text", [
    b'[{"idx": 3, "prompt_token_ids": [1, 50000, 151935], "seed": 9223372036854775807, "t": 0.7}]',
    b'[18446744073709551616, -9223372036854775809, 123456789012345678901234567890]',  # past 64 bits
    b'[0.1234567890123456789, 1e-9, 2.5e308, -0.0]',
    b'[NaN, Infinity, 1e400]', '["\\ud800", "caf\u00e9"]', '{"a": 1, "a": 2}',
])
def test_loads_reads_what_json_reads(text):
    got, want = compact_json.loads(text), json.loads(text)
    assert repr(got) == repr(want)  # repr: an int read as a float, or NaN, would differ
    assert [type(v) for v in (got if isinstance(got, list) else got.values())] == \
        [type(v) for v in (want if isinstance(want, list) else want.values())]


@pytest.mark.parametrize("text", [b"[{", b"\xff", b"", b"[1,]", b'{"a" 1}'])
def test_loads_refuses_what_json_refuses_with_its_message(text):
    with pytest.raises(ValueError) as ours:
        compact_json.loads(text)
    with pytest.raises(ValueError) as theirs:
        json.loads(text)
    assert str(ours.value) == str(theirs.value)


@given(st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text()
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20))
def test_loads_gives_json_loads_values_for_any_value(value):
    text = json.dumps(value, ensure_ascii=False)
    got = compact_json.loads(text.encode("utf-8", "surrogatepass"))
    assert repr(got) == repr(json.loads(text))  # ints past 64 bits stay ints (repr tells 1 from 1.0)


def test_loads_hands_its_options_to_json_where_it_reads():
    def refuse(name: str) -> None:
        raise ValueError(f"no {name}")

    with pytest.raises(ValueError, match="no NaN"):
        compact_json.loads('{"t": NaN}', parse_constant=refuse)
    assert compact_json.loads('{"t": 1.5}', parse_constant=refuse) == {"t": 1.5}
    deep = "[" * 1100 + "]" * 1100  # past orjson's nesting limit: json's own error
    with pytest.raises(RecursionError):
        compact_json.loads(deep)
