"""Streamed input readers: JSONL (plain / OpenAI / gzip), Parquet, DataFrames, records."""

from __future__ import annotations

import gzip
import io
import json
import types

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchinfer.client.inputs import (
    InputError,
    input_name,
    open_input,
    read_jsonl,
    read_parquet,
    read_records,
)


def write(path, text: str | bytes):
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return path


def test_jsonl_lines_keep_numbers_and_skip_blanks(tmp_path):
    f = write(tmp_path / "in.jsonl", '{"prompt": "a"}\n\n   \n{"custom_id": "x", "method": "POST"}\n{bad\n')
    lines = list(read_jsonl(f))
    assert [(x.line, x.body, x.error) for x in lines] == [
        (1, '{"prompt": "a"}', None), (4, '{"custom_id": "x", "method": "POST"}', None), (5, "{bad", None)]


def test_jsonl_without_trailing_newline_and_crlf_and_bom(tmp_path):
    f = write(tmp_path / "in.jsonl", b'\xef\xbb\xbf{"prompt": "a"}\r\n{"prompt": "b"}')
    assert [(x.line, x.body) for x in read_jsonl(f)] == [(1, '{"prompt": "a"}'), (2, '{"prompt": "b"}')]


def test_over_long_line_is_an_error_item_and_reading_goes_on(tmp_path):
    big = '{"prompt": "' + "x" * 5000 + '"}'
    f = write(tmp_path / "in.jsonl", f'{{"prompt": "a"}}\n{big}\n{{"prompt": "c"}}\n')
    lines = list(read_jsonl(f, max_line_bytes=100))
    assert [x.line for x in lines] == [1, 2, 3]
    assert lines[0].body and lines[2].body == '{"prompt": "c"}'
    err = lines[1].error
    assert lines[1].body is None and err.code == "line_too_long" and err.line == 2
    assert "line 2:" in str(err) and "limit of 100 bytes" in str(err) and f"{len(big) + 1} bytes" in str(err)


def test_line_exactly_at_the_limit_is_kept(tmp_path):
    body = '{"prompt": "xy"}'
    f = write(tmp_path / "in.jsonl", body + "\n")
    assert [x.body for x in read_jsonl(f, max_line_bytes=len(body) + 1)] == [body]


def test_non_utf8_line_is_an_error_item(tmp_path):
    f = write(tmp_path / "in.jsonl", b'{"prompt": "a"}\n{"prompt": "\xff"}\n{"prompt": "c"}\n')
    lines = list(read_jsonl(f))
    assert [x.line for x in lines] == [1, 2, 3]
    assert lines[1].error.code == "invalid_json" and "not UTF-8" in str(lines[1].error)
    assert str(lines[1].error).startswith("line 2: ")


def test_gzip_and_file_objects(tmp_path):
    f = tmp_path / "in.jsonl.gz"
    with gzip.open(f, "wt") as g:
        g.write('{"prompt": "a"}\n{"prompt": "b"}\n')
    assert [x.body for x in open_input(f)] == ['{"prompt": "a"}', '{"prompt": "b"}']
    stream = io.BytesIO(b'{"prompt": "z"}\n')
    assert [x.body for x in open_input(stream)] == ['{"prompt": "z"}']


def test_missing_file_fails_before_reading(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        open_input(tmp_path / "nope.jsonl")
    with pytest.raises(InputError, match="no such file"):
        open_input(tmp_path / "nope.parquet")


def test_large_file_is_streamed(tmp_path):
    """200k lines come through a generator, one at a time, with the right numbers."""
    f = tmp_path / "big.jsonl"
    with open(f, "w") as out:
        for i in range(200_000):
            out.write(json.dumps({"custom_id": f"r{i}", "prompt": "p" * (i % 50 + 1)}) + "\n")
    lines = read_jsonl(f)
    assert isinstance(lines, types.GeneratorType)  # nothing is read until asked for
    first = next(lines)
    assert first.line == 1 and json.loads(first.body)["custom_id"] == "r0"
    count, last = 1, first
    for item in lines:
        count, last = count + 1, item
    assert count == 200_000 and last.line == 200_000 and json.loads(last.body)["custom_id"] == "r199999"


def test_parquet_prompt_column_with_nulls(tmp_path):
    table = pa.table({"custom_id": ["a", "b", None], "prompt": ["x", "y", "z"],
                      "max_tokens": [3, None, 5], "temperature": [0.0, 0.5, None]})
    f = tmp_path / "in.parquet"
    pq.write_table(table, f, row_group_size=2)
    lines = list(read_parquet(f, batch_rows=2))
    assert [x.line for x in lines] == [1, 2, 3]
    assert [json.loads(x.body) for x in lines] == [
        {"custom_id": "a", "prompt": "x", "max_tokens": 3, "temperature": 0.0},
        {"custom_id": "b", "prompt": "y", "temperature": 0.5},
        {"prompt": "z", "max_tokens": 5}]


def test_parquet_messages_as_structs_and_as_json_text(tmp_path):
    msgs = [[{"role": "user", "content": "hi"}], [{"role": "system", "content": "s"},
                                                  {"role": "user", "content": "q"}]]
    f = tmp_path / "chat.parquet"
    pq.write_table(pa.table({"messages": msgs}), f)
    assert [json.loads(x.body)["messages"] for x in read_parquet(f)] == msgs
    g = tmp_path / "chat_text.parquet"
    pq.write_table(pa.table({"messages": [json.dumps(m) for m in msgs] + ["not json"]}), g)
    bodies = [json.loads(x.body) for x in read_parquet(g)]
    assert [b["messages"] for b in bodies[:2]] == msgs
    assert bodies[2]["messages"] == "not json"  # left for the scheduler to reject with its line


def test_parquet_schema_errors(tmp_path):
    f = tmp_path / "noprompt.parquet"
    pq.write_table(pa.table({"text": ["a"]}), f)
    with pytest.raises(InputError, match="needs a 'prompt', 'messages' or 'prompt_token_ids' column"):
        read_parquet(f)
    g = tmp_path / "extra.parquet"
    pq.write_table(pa.table({"prompt": ["a"], "colour": ["red"]}), g)
    with pytest.raises(InputError, match="colour are not request fields"):
        read_parquet(g)
    h = write(tmp_path / "fake.parquet", "this is not parquet")
    with pytest.raises(InputError, match="not a readable Parquet file"):
        read_parquet(h)


def test_dataframe_with_float_ints_from_missing_values():
    df = pd.DataFrame({"prompt": ["a", "b"], "max_tokens": [4, None], "custom_id": ["x", "y"]})
    assert df["max_tokens"].dtype == float
    bodies = [json.loads(x.body) for x in open_input(df)]
    assert bodies == [{"prompt": "a", "max_tokens": 4, "custom_id": "x"}, {"prompt": "b", "custom_id": "y"}]
    assert isinstance(bodies[0]["max_tokens"], int)


def test_records_dicts_strings_and_errors():
    records = [{"prompt": "a"}, '{"prompt": "b"}', b'{"prompt": "c"}', b"\xff", {"prompt": object()},
               {"prompt": "x" * 200}]
    lines = list(read_records(records, max_line_bytes=100))
    assert [x.line for x in lines] == [1, 2, 3, 4, 5, 6]
    assert [x.body for x in lines[:3]] == ['{"prompt":"a"}', '{"prompt": "b"}', '{"prompt": "c"}']
    assert [x.error.code for x in lines[3:]] == ["invalid_json", "invalid_request", "line_too_long"]
    assert all(str(x.error).startswith(f"line {x.line}: ") for x in lines[3:])


def test_input_names(tmp_path):
    assert input_name(tmp_path / "a.jsonl") == "a.jsonl"
    assert input_name("-") == "<stdin>"
    assert input_name(pd.DataFrame({"prompt": ["a"]})) == "<dataframe>"
    assert input_name([{"prompt": "a"}]) == "<records>"
