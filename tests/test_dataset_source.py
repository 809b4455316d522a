"""DatasetSource (batchinfer/datasets/source.py, listing.py) on real files: a local Hive dataset of
three partitions, globs, lists of files, single Parquet / CSV / JSON-lines files, DataFrames and
pyarrow data in memory; partition pruning, row numbers before filtering, batch-bounded scans, files
that are never data, and the errors that stop an input as a whole."""

from __future__ import annotations

import json
import os
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from batchinfer.datasets.source import DatasetFile, DatasetSource, InputError

DATES = ("2026-12-01", "2026-12-02", "2026-12-03")
ROWS = 40  # per partition


def _rows(date_index: int, count: int = ROWS) -> pa.Table:
    """Rows whose ``n`` is their 1-based row number in the file and ``id`` unique over the dataset."""
    return pa.table({"id": pa.array([date_index * 1000 + n for n in range(1, count + 1)], pa.int64()),
                     "n": pa.array(range(1, count + 1), pa.int64()),
                     "text": [f"row {n}" for n in range(1, count + 1)],
                     "keep": [n % 3 == 0 for n in range(1, count + 1)]})


@pytest.fixture
def hive(tmp_path) -> Path:
    """events/date=<d>/part-0.parquet for three dates (small row groups: several batches a file),
    plus what is never data: _manifests/, _SUCCESS, hidden files, a _temporary folder."""
    root = tmp_path / "events"
    for i, date in enumerate(DATES):
        folder = root / f"date={date}"
        folder.mkdir(parents=True)
        pq.write_table(_rows(i), folder / "part-0.parquet", row_group_size=16)
        (folder / ".part-0.parquet.crc").write_bytes(b"\x00garbage")
    (root / "_manifests").mkdir()
    (root / "_manifests" / "abc.json").write_text(json.dumps({"unit": "abc"}))
    (root / "_SUCCESS").write_text("")
    (root / ".hidden.parquet").write_text("not parquet")
    (root / "_temporary" / "date=2026-12-09").mkdir(parents=True)
    (root / "_temporary" / "date=2026-12-09" / "part-9.parquet").write_text("half written")
    return root


def scanned(source: DatasetSource, **kwargs) -> list[tuple[str, dict, list[int]]]:
    return [(b.file.relative, b.rows.to_pydict(), b.row_numbers.to_pylist()) for b in source.scan(**kwargs)]


def all_rows(source: DatasetSource, **kwargs) -> list[dict]:
    """Every scanned row as a dict, with ``__file`` (relative) and ``__row`` (its row number)."""
    out = []
    for b in source.scan(**kwargs):
        for row, number in zip(b.rows.to_pylist(), b.row_numbers.to_pylist(), strict=True):
            out.append({**row, "__file": b.file.relative, "__row": number})
    return out


def test_a_hive_folder_lists_its_partitions(hive):
    source = DatasetSource(hive)
    files = source.files()
    assert [f.relative for f in files] == [f"date={d}/part-0.parquet" for d in DATES]
    assert [f.partition for f in files] == [{"date": d} for d in DATES]
    assert [f.location for f in files] == [str(hive / f.relative) for f in files]
    assert [f.size for f in files] == [os.path.getsize(hive / f.relative) for f in files]
    assert source.partition_keys == ["date"]
    assert source.schema.names == ["id", "n", "text", "keep", "date"]  # data, then partitions
    assert (source.name, source.root, source.format) == ("events", str(hive), "parquet")


def test_a_scan_gives_every_row_with_its_partition_and_number(hive):
    rows = all_rows(DatasetSource(hive), batch_rows=10)
    assert len(rows) == 3 * ROWS
    assert sorted(r["id"] for r in rows) == sorted(i * 1000 + n for i in range(3) for n in range(1, ROWS + 1))
    for r in rows:
        assert r["__file"] == f"date={r['date']}/part-0.parquet"
        assert r["__row"] == r["n"]  # 1-based, in file order
    # files in files() order, rows in file order
    assert [(r["__file"], r["__row"]) for r in rows] == sorted((r["__file"], r["__row"]) for r in rows)


def test_files_that_are_never_data_are_ignored(hive):
    # each of them is garbage as Parquet: reading any would fail the scan
    source = DatasetSource(hive)
    assert all(not part.startswith(("_", ".")) for f in source.files() for part in f.relative.split("/"))
    assert len(all_rows(source)) == 3 * ROWS
    assert len(all_rows(DatasetSource(str(hive) + "/**"))) == 3 * ROWS


def test_asked_columns_only_in_the_asked_order(hive):
    batch = next(iter(DatasetSource(hive).scan(["date", "id"], batch_rows=5)))
    assert batch.rows.schema.names == ["date", "id"]
    assert batch.rows.num_rows == 5
    assert batch.rows.column("date").to_pylist() == [DATES[0]] * 5


def test_the_partition_filter_prunes_files(hive):
    only_one = DatasetSource(hive, where="date = '2026-12-02'")
    assert [f.partition["date"] for f in only_one.files()] == ["2026-12-02"]
    assert {r["date"] for r in all_rows(only_one)} == {"2026-12-02"}
    two = DatasetSource(hive, partitions=["date=2026-12-01", "date=2026-12-03"])
    assert [f.partition["date"] for f in two.files()] == ["2026-12-01", "2026-12-03"]
    assert [f.partition["date"] for f in DatasetSource(hive, where="date >= '2026-12-02'").files()] == \
        ["2026-12-02", "2026-12-03"]
    # a condition on data columns cannot prune: every file is kept, rows are filtered
    assert len(DatasetSource(hive, where="id > 5").files()) == 3
    mixed = DatasetSource(hive, where="date = '2026-12-01' OR id = 2001")
    assert len(mixed.files()) == 3
    assert sorted(r["id"] for r in all_rows(mixed)) == [*range(1, ROWS + 1), 2001]
    # where and partitions are ANDed
    both = DatasetSource(hive, where="n <= 2", partitions=["date=2026-12-03"])
    assert [r["id"] for r in all_rows(both)] == [2001, 2002]


def test_row_numbers_are_counted_before_the_row_filter(hive):
    source = DatasetSource(hive, where="keep = TRUE AND n > 10")
    rows = all_rows(source, columns=["id", "n"], batch_rows=7)
    assert rows and all(r["__row"] == r["n"] for r in rows)
    assert [r["n"] for r in rows if r["__file"].startswith("date=2026-12-01")] == \
        [n for n in range(11, ROWS + 1) if n % 3 == 0]
    # the filter's own columns are read but not returned unless asked
    assert set(rows[0]) == {"id", "n", "__file", "__row"}


def test_scans_are_bounded_batches(tmp_path):
    path = tmp_path / "big.parquet"
    pq.write_table(_rows(0, 1000), path, row_group_size=300)
    batches = list(DatasetSource(path).scan(batch_rows=7))
    assert max(b.rows.num_rows for b in batches) <= 7
    assert len(batches) >= 1000 // 7
    numbers = [n for b in batches for n in b.row_numbers.to_pylist()]
    assert numbers == list(range(1, 1001))
    assert [n for b in batches for n in b.rows.column("n").to_pylist()] == numbers
    # a scan is lazy: the first batch comes before the rest are read
    scan = DatasetSource(path).scan(batch_rows=7)
    assert next(scan).row_numbers.to_pylist() == list(range(1, 8))


def test_globs(hive):
    two = DatasetSource(f"{hive}/date=2026-12-0[12]/*.parquet")
    assert [f.relative for f in two.files()] == [f"date={d}/part-0.parquet" for d in DATES[:2]]
    assert two.root == str(hive) and two.partition_keys == ["date"]
    assert {r["date"] for r in all_rows(two)} == set(DATES[:2])
    every = DatasetSource(f"{hive}/**/*.parquet")
    assert len(every.files()) == 3
    # * stays within one folder
    with pytest.raises(InputError, match=r"\*\.parquet matches no file"):
        DatasetSource(f"{hive}/*.parquet").files()
    one = DatasetSource(f"{hive}/date=2026-12-0?/part-?.parquet", where="date = '2026-12-03'")
    assert [f.partition for f in one.files()] == [{"date": "2026-12-03"}]


def test_a_list_of_files(hive, tmp_path):
    paths = [hive / "date=2026-12-03" / "part-0.parquet", str(hive / "date=2026-12-01" / "part-0.parquet")]
    source = DatasetSource(paths)
    assert [f.relative for f in source.files()] == [f"date={d}/part-0.parquet" for d in (DATES[0], DATES[2])]
    assert source.root == str(hive) and source.partition_keys == ["date"]
    assert {r["date"] for r in all_rows(source)} == {"2026-12-01", "2026-12-03"}
    # files of one folder: their base names
    flat = tmp_path / "flat"
    flat.mkdir()
    for name in ("b.parquet", "a.parquet"):
        pq.write_table(_rows(0, 3), flat / name)
    listed = DatasetSource([flat / "b.parquet", flat / "a.parquet"])
    assert [f.relative for f in listed.files()] == ["a.parquet", "b.parquet"]
    assert listed.partition_keys == [] and listed.name == "flat"
    assert [b.row_numbers.to_pylist() for b in listed.scan()] == [[1, 2, 3], [1, 2, 3]]


def test_single_files_of_each_format(tmp_path):
    table = _rows(0, 5)
    pq.write_table(table, tmp_path / "t.parquet")
    pq.write_table(table, tmp_path / "t.pq")
    (tmp_path / "t.csv").write_text("id,n,text,keep\n" + "".join(
        f"{r['id']},{r['n']},{r['text']},{str(r['keep']).lower()}\n" for r in table.to_pylist()))
    lines = "".join(json.dumps(r) + "\n" for r in table.to_pylist())
    for name in ("t.jsonl", "t.json", "t.ndjson"):
        (tmp_path / name).write_text(lines)
    for name, fmt in [("t.parquet", "parquet"), ("t.pq", "parquet"), ("t.csv", "csv"), ("t.jsonl", "json"),
                      ("t.json", "json"), ("t.ndjson", "json")]:
        source = DatasetSource(tmp_path / name)
        (file,) = source.files()
        assert file == DatasetFile(str(tmp_path / name), name, os.path.getsize(tmp_path / name), {})
        assert (source.name, source.root, source.format) == (name, str(tmp_path), fmt)
        rows = all_rows(source, columns=["id", "text"])
        assert [(r["id"], r["text"], r["__row"]) for r in rows] == \
            [(r["id"], r["text"], r["n"]) for r in table.to_pylist()], name
    # a name without a known suffix, read with format=
    (tmp_path / "lines.txt").write_text(lines)
    assert len(all_rows(DatasetSource(tmp_path / "lines.txt", format="json"))) == 5
    with pytest.raises(InputError, match="cannot tell the format of .*lines.txt.*format="):
        DatasetSource(tmp_path / "lines.txt").files()


def test_a_csv_folder_and_a_file_uri(tmp_path):
    for date in DATES[:2]:
        folder = tmp_path / "csv" / f"date={date}"
        folder.mkdir(parents=True)
        (folder / "rows.csv").write_text("id,text\n1,a\n2,b\n")
    source = DatasetSource(f"file://{tmp_path}/csv", where="date = '2026-12-02' AND id = 2")
    assert source.root == str(tmp_path / "csv")
    assert all_rows(source) == [{"id": 2, "text": "b", "date": "2026-12-02",
                                 "__file": "date=2026-12-02/rows.csv", "__row": 2}]


@pytest.mark.parametrize("make, name", [
    (lambda t: t, "<table>"),
    (lambda t: ds.dataset(t), "<table>"),
    (lambda t: t.to_pandas(), "<dataframe>"),
    (lambda t: pl.from_arrow(t), "<dataframe>"),
])
def test_data_in_memory_is_one_pseudo_file(make, name):
    table = _rows(0, 25)
    source = DatasetSource(make(table), where="keep = TRUE")
    assert source.files() == [DatasetFile(name, name, None, {})]
    assert (source.name, source.root, source.partition_keys, source.format) == (name, "", [], None)
    assert set(source.schema.names) == {"id", "n", "text", "keep"}
    batches = list(source.scan(["n", "text"], batch_rows=4))
    assert max(b.rows.num_rows for b in batches) <= 4
    rows = [(n, t, number) for b in batches
            for n, t, number in zip(b.rows.column("n").to_pylist(), b.rows.column("text").to_pylist(),
                                    b.row_numbers.to_pylist(), strict=True)]
    assert rows == [(n, f"row {n}", n) for n in range(3, 26, 3)]
    with pytest.raises(InputError, match="no Hive partitions"):
        DatasetSource(make(table), partitions=["date=x"]).files()


def test_a_pyarrow_file_dataset_keeps_its_files_and_partitioning(hive):
    source = DatasetSource(ds.dataset(hive, partitioning="hive"), where="date = '2026-12-03'")
    assert [f.relative for f in source.files()] == ["date=2026-12-03/part-0.parquet"]
    assert source.files()[0].partition == {"date": "2026-12-03"}
    assert source.partition_keys == ["date"] and source.root == str(hive)
    assert len(all_rows(source)) == ROWS


def test_restricted_and_only(hive):
    source = DatasetSource(hive, where="n = 1")
    files = source.files()
    unit = source.restricted(files[1:2])
    assert unit.files() == files[1:2] and source.files() == files
    assert [r["id"] for r in all_rows(unit)] == [1001]
    again = DatasetSource(hive, only=files[2:])
    assert again.files() == files[2:]
    gone = DatasetFile(str(hive / "date=2026-12-31" / "part-0.parquet"), "x", 1, {})
    with pytest.raises(InputError, match="is not .* a file of"):
        DatasetSource(hive, only=[gone]).files()


def test_missing_paths(tmp_path):
    with pytest.raises(InputError, match=f"no such file or folder: {tmp_path}/nothere"):
        DatasetSource(tmp_path / "nothere").files()
    with pytest.raises(InputError, match=f"no such file or folder: {tmp_path}/a.parquet"):
        DatasetSource([tmp_path / "a.parquet"]).files()
    with pytest.raises(InputError, match="does not exist"):
        DatasetSource(f"{tmp_path}/nothere/*.parquet").files()
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="holds no file"):
        DatasetSource(tmp_path / "empty").files()


def test_filter_errors(hive):
    with pytest.raises(InputError, match=r"bad filter .* at position 8"):
        DatasetSource(hive, where="date = ")
    with pytest.raises(InputError, match=r"'lang'.*\(columns: id, n, text, keep, date\)"):
        DatasetSource(hive, where="lang = 'en'").files()
    with pytest.raises(InputError, match=r"matches no file of .*events \(partitions: date=2026-12-01, "):
        DatasetSource(hive, where="date = '2027-01-01'").files()
    with pytest.raises(InputError, match="matches no file"):
        DatasetSource(hive, partitions=["date=2027-01-01"]).files()
    with pytest.raises(InputError, match=r"'lang' is not a partition key of .* \(keys: date\)"):
        DatasetSource(hive, partitions=["lang=en"]).files()
    with pytest.raises(InputError, match="is not KEY=VALUE"):
        DatasetSource(hive, partitions=["2026-12-03"])
    with pytest.raises(InputError, match=r"has no column 'lang' \(columns: id, n, text, keep, date\)"):
        DatasetSource(hive).scan(["id", "lang"])


def test_files_unreadable_as_their_format(tmp_path):
    (tmp_path / "bad.parquet").write_text("not parquet at all")
    with pytest.raises(InputError, match=r"bad.parquet is not a readable parquet file"):
        _ = DatasetSource(tmp_path / "bad.parquet").schema
    # a later file of a folder fails when the scan reaches it, naming it
    folder = tmp_path / "mixed"
    folder.mkdir()
    pq.write_table(_rows(0, 3), folder / "a.parquet")
    (folder / "b.parquet").write_text("not parquet at all")
    scan = DatasetSource(folder).scan()
    assert next(scan).file.relative == "a.parquet"
    with pytest.raises(InputError, match=r"mixed/b.parquet is not a readable parquet file"):
        next(scan)
    (tmp_path / "bad.jsonl").write_text('{"a": 1}\n{"a": oops}\n')
    with pytest.raises(InputError, match=r"bad.jsonl is not a readable json file"):
        list(DatasetSource(tmp_path / "bad.jsonl").scan())


def test_format_choices(tmp_path):
    folder = tmp_path / "both"
    folder.mkdir()
    pq.write_table(_rows(0, 3), folder / "a.parquet")
    (folder / "b.csv").write_text("id\n1\n")
    (folder / "README.md").write_text("# not data")
    with pytest.raises(InputError, match="mixes csv and parquet: give format="):
        DatasetSource(folder).files()
    assert [f.relative for f in DatasetSource(folder, format="csv").files()] == ["b.csv"]
    with pytest.raises(InputError, match="unknown format 'xlsx'"):
        DatasetSource(folder, format="xlsx")
    with pytest.raises(InputError, match="cannot read a int as a dataset"):
        DatasetSource(42)
