"""Embedding inputs: `input` lines and columns (strings, lists, token ids), a `text` column named
with input_column, numpy cells, and the example file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchinfer.client.inputs import InputError, open_input, read_parquet, read_records

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "embeddings.jsonl"


def bodies(lines) -> list[dict]:
    return [json.loads(x.body) for x in lines]


def test_parquet_input_column_of_strings_lists_and_token_ids(tmp_path):
    f = tmp_path / "texts.parquet"
    pq.write_table(pa.table({"custom_id": ["a", "b"], "input": ["one text", "another"],
                             "dimensions": [8, None]}), f)
    assert bodies(open_input(f)) == [{"custom_id": "a", "input": "one text", "dimensions": 8},
                                     {"custom_id": "b", "input": "another"}]
    g = tmp_path / "lists.parquet"
    pq.write_table(pa.table({"input": [["x", "y"], ["z"]], "encoding_format": ["base64", "float"]}), g)
    assert bodies(read_parquet(g)) == [{"input": ["x", "y"], "encoding_format": "base64"},
                                       {"input": ["z"], "encoding_format": "float"}]
    h = tmp_path / "ids.parquet"
    pq.write_table(pa.table({"input": pa.array([[101, 7592, 102], [101, 102]], pa.list_(pa.int32()))}), h)
    assert bodies(read_parquet(h)) == [{"input": [101, 7592, 102]}, {"input": [101, 102]}]


def test_a_text_column_is_the_input_when_named(tmp_path):
    f = tmp_path / "corpus.parquet"
    pq.write_table(pa.table({"custom_id": ["d1", "d2"], "text": ["first doc", "second doc"]}), f)
    with pytest.raises(InputError, match="or 'input' for embeddings.*input_column"):
        read_parquet(f)
    assert bodies(open_input(f, input_column="text")) == [{"custom_id": "d1", "input": "first doc"},
                                                         {"custom_id": "d2", "input": "second doc"}]
    with pytest.raises(InputError, match="input_column 'body' is not a column"):
        read_parquet(f, input_column="body")
    both = tmp_path / "both.parquet"
    pq.write_table(pa.table({"text": ["a"], "input": ["b"]}), both)
    with pytest.raises(InputError, match="has an 'input' column already"):
        read_parquet(both, input_column="text")
    with pytest.raises(InputError, match="Parquet files only"):
        open_input(tmp_path / "x.jsonl", input_column="text")


def test_dataframes_and_records_with_numpy_cells():
    df = pd.DataFrame({"text": ["a", "b"], "dimensions": [4, None]})
    assert bodies(open_input(df, input_column="text")) == [{"input": "a", "dimensions": 4}, {"input": "b"}]
    # rows of pd.read_parquet with a list column hold numpy arrays: they go out as JSON lists
    records = [{"input": np.array([1, 2, 3], dtype=np.int64)}, {"input": np.array(["p", "q"], dtype=object)}]
    assert bodies(read_records(records)) == [{"input": [1, 2, 3]}, {"input": ["p", "q"]}]
    ids = pd.DataFrame({"input": [np.array([5, 6]), np.array([7])]})
    assert bodies(open_input(ids)) == [{"input": [5, 6]}, {"input": [7]}]


def test_the_example_file_is_openai_embedding_lines_with_two_bad_ones():
    lines = list(open_input(EXAMPLE))
    parsed = bodies(lines)
    assert len(parsed) >= 12 and all(p["url"] == "/v1/embeddings" and p["method"] == "POST" for p in parsed)
    assert len({p["custom_id"] for p in parsed}) == len(parsed)
    inputs = [p["body"]["input"] for p in parsed]
    good = [i for i in inputs if (isinstance(i, str) and i.strip()) or
            (isinstance(i, list) and i and all(isinstance(x, str) and x for x in i))]
    assert len(inputs) - len(good) == 2  # an empty input and one of the wrong type
    assert any(isinstance(i, list) for i in good)  # a list input: one vector per element
