"""The --where language (batchinfer/datasets/filters.py): parsing, precedence, errors with positions,
literals cast to each column's type, and --partition pairs. Expressions are checked by filtering a real
pyarrow table, so a wrong tree shows as wrong rows."""

from __future__ import annotations

import datetime as dt

import pyarrow as pa
import pytest

from batchinfer.datasets.filters import RowFilter, partition_filter

TABLE = pa.table({
    "id": pa.array([1, 2, 3, 4, 5], pa.int64()),
    "lang": ["en", "fr", None, "en", "it's"],
    "score": [0.5, 1.5, 2.5, None, 4.0],
    "ok": [True, False, True, False, None],
    "day": pa.array([dt.date(2026, 12, d) for d in (1, 2, 3, 3, 4)], pa.date32()),
    # Hive partitions: date typed string, year typed int32
    "date": ["2026-12-01", "2026-12-02", "2026-12-03", "2026-12-03", "2026-12-04"],
    "year": pa.array([2025, 2026, 2026, 2026, 2027], pa.int32()),
    "at": pa.array([dt.datetime(2026, 12, 3, h) for h in (1, 5, 9, 13, 17)], pa.timestamp("us")),
    "tag": pa.array(["a", "b", "a", "b", "c"]).dictionary_encode(),
})


def ids(text: str, table: pa.Table = TABLE) -> list[int]:
    return table.filter(RowFilter.parse(text).expression(table.schema))["id"].to_pylist()


@pytest.mark.parametrize("text, expected", [
    ("id = 3", [3]),
    ("id != 3", [1, 2, 4, 5]),
    ("id <> 3", [1, 2, 4, 5]),
    ("id < 3", [1, 2]),
    ("id <= 3", [1, 2, 3]),
    ("id > 3", [4, 5]),
    ("id >= 3", [3, 4, 5]),
    ("lang = 'en'", [1, 4]),
    ("lang != 'en'", [2, 5]),  # SQL: a null matches no comparison
    ("lang = 'it''s'", [5]),
    ("lang IN ('fr', 'en')", [1, 2, 4]),
    ("lang NOT IN ('fr', 'en')", [5]),
    ("lang IS NULL", [3]),
    ("lang is not null", [1, 2, 4, 5]),
    ("score > 1", [2, 3, 5]),
    ("score >= 1.5e0", [2, 3, 5]),
    ("id > 2.5", [3, 4, 5]),  # a fraction against an int column compares exactly
    ("score > -1 AND score < .6", [1]),
    ("ok = TRUE", [1, 3]),
    ("ok = false", [2, 4]),
    ("\"lang\" = 'fr'", [2]),
    ("tag = 'a'", [1, 3]),
])
def test_comparisons(text, expected):
    assert ids(text) == expected


def test_and_binds_tighter_than_or_and_not_tighter_than_and():
    assert ids("id = 1 OR id = 2 AND lang = 'en'") == [1]  # 1 OR (2 AND en)
    assert ids("(id = 1 OR id = 2) AND lang = 'fr'") == [2]
    assert ids("NOT id = 1 AND id < 3") == [2]  # (NOT id = 1) AND id < 3
    assert ids("NOT (id = 1 OR id = 2)") == [3, 4, 5]
    assert ids("NOT NOT id = 4") == [4]
    assert ids("id = 1 or id = 2 or id = 5 and not lang is null") == [1, 2, 5]


def test_literals_are_cast_to_the_columns_type():
    # one text against a string partition, a date32 column and a timestamp column
    assert ids("date = '2026-12-03'") == [3, 4]
    assert ids("day = '2026-12-03'") == [3, 4]
    assert ids("day >= DATE '2026-12-03'") == [3, 4, 5]
    assert ids("date = DATE '2026-12-03'") == [3, 4]  # a DATE literal against a string partition
    assert ids("at > TIMESTAMP '2026-12-03 10:00:00'") == [4, 5]
    assert ids("at < '2026-12-03T06:00:00'") == [1, 2]
    # an int32 partition, with a number or a text
    assert ids("year = 2026") == [2, 3, 4]
    assert ids("year = '2026'") == [2, 3, 4]
    assert ids("year IN (2025, '2027')") == [1, 5]
    # a number against a text column
    table = pa.table({"id": [1, 2], "code": ["42", "7"]})
    assert ids("code = 42", table) == [1]


def test_columns_named_date_and_timestamp_need_no_quotes():
    table = pa.table({"id": [1, 2], "timestamp": ["x", "y"], "date": ["2026-12-03", "2026-12-04"]})
    assert ids("timestamp = 'y'", table) == [2]
    assert ids("date = DATE '2026-12-04'", table) == [2]


def test_columns_is_every_name_read():
    f = RowFilter.parse("a = 1 AND (\"b c\" IN ('x') OR NOT d IS NULL)")
    assert f.columns == frozenset({"a", "b c", "d"})
    assert f.text == "a = 1 AND (\"b c\" IN ('x') OR NOT d IS NULL)"


def test_and_combines_two_filters():
    both = RowFilter.parse("id > 1 OR id = 0") & RowFilter.parse("lang = 'en'")
    assert ids(both.text) == [4]  # the combined text parses to the same tree
    assert TABLE.filter(both.expression(TABLE.schema))["id"].to_pylist() == [4]
    assert both.columns == frozenset({"id", "lang"})


@pytest.mark.parametrize("text, position, what", [
    ("", 1, "expected a condition"),
    ("id =", 5, "expected a value"),
    ("id = 1 AND", 11, "expected a column name"),
    ("id == 1", 5, "expected a value"),
    ("(id = 1", 8, "expected ')'"),
    ("id = 1)", 7, "expected AND, OR or the end"),
    ("id 1", 4, "expected a comparison"),
    ("lang = 'en", 8, "unclosed '"),
    ("\"lang = 'en'", 1, 'unclosed "'),
    ("id = 1 ; drop", 8, "unexpected character ';'"),
    ("lang IN ()", 10, "expected a value"),
    ("lang IN ('a' 'b')", 14, "expected ')' or ','"),
    ("lang = NULL", 8, "IS NULL"),
    ("lang IS 'x'", 9, "expected NULL"),
    ("lang NOT = 'x'", 10, "expected IN after NOT"),
    ("day = DATE '2026-13-01'", 12, "not a valid DATE"),
    ("day = DATE 3", 12, "a quoted text after DATE"),
    ("in = 1", 1, "expected a column name"),
])
def test_syntax_errors_name_the_position(text, position, what):
    with pytest.raises(ValueError) as info:
        RowFilter.parse(text)
    message = str(info.value)
    assert f"at position {position} " in message
    assert what in message
    assert repr(text) in message


def test_unknown_column_lists_the_columns():
    f = RowFilter.parse("id = 1 AND nope = 'x'")
    columns = r"\(columns: id, lang, score, ok, day, date, year, at, tag\)"
    with pytest.raises(ValueError, match=r"'nope'.*" + columns):
        f.expression(TABLE.schema)


@pytest.mark.parametrize("text", ["id = 'abc'", "day = '2026-02-30'", "year = 'twenty'", "id IN (1, 'x')"])
def test_impossible_casts_are_value_errors(text):
    with pytest.raises(ValueError, match="cannot be read as"):
        RowFilter.parse(text).expression(TABLE.schema)


def test_parsing_runs_no_code():
    with pytest.raises(ValueError):
        RowFilter.parse("__import__('os').system('true')")


def test_partition_filter_pairs():
    assert partition_filter([]) is None
    assert ids(partition_filter(["date=2026-12-03"]).text) == [3, 4]
    # one key twice: either value; two keys: both
    assert ids(partition_filter(["date=2026-12-01", "date=2026-12-04"]).text) == [1, 5]
    assert ids(partition_filter(["date=2026-12-03", "year=2026"]).text) == [3, 4]
    assert ids(partition_filter(["year=2026", "date=2026-12-01"]).text) == []
    assert partition_filter(["year=2026", "date=x"]).columns == frozenset({"year", "date"})
    # quotes and keywords survive the round trip through the filter text
    table = pa.table({"id": [1, 2], "in": ["it's", "x"]})
    assert ids(partition_filter(["in=it's"]).text, table) == [1]


@pytest.mark.parametrize("pair", ["date", "=2026", ""])
def test_partition_filter_rejects_a_pair_without_a_key(pair):
    with pytest.raises(ValueError, match="is not KEY=VALUE"):
        partition_filter([pair])
