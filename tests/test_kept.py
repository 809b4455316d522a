"""The kept table: input columns written beside the requests, read back with their types and order."""

from __future__ import annotations

import datetime
import decimal

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from batchinfer.datasets import kept
from batchinfer.datasets.kept import FILE_COLUMN, ROW_COLUMN, KeptReader, KeptWriter, kept_location

SCHEMA = pa.schema([
    pa.field("day", pa.date32()),
    pa.field("at", pa.timestamp("us", tz="UTC")),
    pa.field("id", pa.int64()),
    pa.field("lang", pa.string()),
    pa.field("tags", pa.list_(pa.string())),
    pa.field("price", pa.decimal128(10, 2)),
])
META = {"input": "/data/events", "unit": "abc", "files": [{"location": "/data/events/a.parquet",
                                                          "relative": "a.parquet", "size": 10}],
        "keep_columns": ["day", "at", "id", "lang", "tags", "price"], "partition_by": []}


def rows(start: int, n: int) -> pa.RecordBatch:
    day0 = datetime.date(2026, 12, 3)
    return pa.RecordBatch.from_pylist([
        {"day": day0 + datetime.timedelta(days=i % 3),
         "at": datetime.datetime(2026, 12, 3, tzinfo=datetime.timezone.utc) + datetime.timedelta(seconds=i),
         "id": i, "lang": None if i % 5 == 0 else f"l{i}", "tags": [str(i)] * (i % 3) if i % 7 else None,
         "price": decimal.Decimal(i) / 100}
        for i in range(start, start + n)], schema=SCHEMA)


def test_kept_location_is_under_the_file_store():
    assert kept_location("file:///srv/files/", "job-1") == "file:///srv/files/kept/job-1.parquet"
    assert kept_location("s3://b/files", "j") == "s3://b/files/kept/j.parquet"


@pytest.fixture
def small_groups(monkeypatch):
    """Row groups of 100 rows, so that a few hundred rows span several."""
    monkeypatch.setattr(kept, "_ROW_GROUP_ROWS", 100)


def test_round_trip_keeps_types_values_meta_and_order(tmp_path, small_groups):
    location = str(tmp_path / "kept" / "j.parquet")
    writer = KeptWriter(location, SCHEMA, META)
    # many batches of odd sizes (an empty one too), two files: the row groups span batches
    sizes = [3, 0, 150, 1, 700, 17]
    start = 0
    for i, n in enumerate(sizes):
        batch = rows(start, n)
        writer.add(batch, i % 2, pa.array(range(start + 1, start + n + 1), pa.int64()))
        start += n
    assert writer.close() == location
    reader = KeptReader(location)
    assert reader.schema == SCHEMA
    assert reader.rows == start == writer.rows
    assert reader.meta == {"version": 1, **META}
    table = pa.Table.from_batches(list(reader.batches(batch_rows=64)))
    assert table.schema.names == [*SCHEMA.names, FILE_COLUMN, ROW_COLUMN]
    assert table.schema.field(FILE_COLUMN).type == pa.int32()
    assert table.schema.field(ROW_COLUMN).type == pa.int64()
    assert table.select(SCHEMA.names).cast(SCHEMA).equals(
        pa.Table.from_batches([rows(0, start)]).cast(SCHEMA))
    assert table.column(ROW_COLUMN).to_pylist() == list(range(1, start + 1))
    files = table.column(FILE_COLUMN).to_pylist()
    assert files[:3] == [0, 0, 0] and files[3:3 + 150] == [0] * 150  # batch 2 (index 2) is file 0
    assert files[153] == 1 and files[-1] == 1  # batch 3: file 1, batch 5: file 1
    assert pq.ParquetFile(location).metadata.num_row_groups >= 2  # buffered, not one group per batch


def test_partition_columns_read_as_dictionaries_are_written_as_declared(tmp_path):
    schema = pa.schema([pa.field("date", pa.string()), pa.field("id", pa.int32())])
    writer = KeptWriter(str(tmp_path / "k.parquet"), schema, {})
    date = pa.array(["2026-12-03", "2026-12-03"]).dictionary_encode()
    writer.add(pa.RecordBatch.from_arrays([pa.array([1, 2], pa.int64()), date], names=["id", "date"]),
               0, pa.array([1, 2], pa.int32()))
    writer.close()
    reader = KeptReader(str(tmp_path / "k.parquet"))
    batch = next(reader.batches())
    assert reader.schema == schema
    assert batch.to_pylist() == [{"date": "2026-12-03", "id": 1, FILE_COLUMN: 0, ROW_COLUMN: 1},
                                 {"date": "2026-12-03", "id": 2, FILE_COLUMN: 0, ROW_COLUMN: 2}]


def test_an_empty_table_is_a_readable_file(tmp_path):
    location = str(tmp_path / "sub" / "k.parquet")
    KeptWriter(location, SCHEMA, META).close()
    reader = KeptReader(location)
    assert reader.rows == 0 and reader.schema == SCHEMA and list(reader.batches()) == []


def test_abort_leaves_no_file(tmp_path, small_groups):
    location = tmp_path / "k.parquet"
    writer = KeptWriter(str(location), SCHEMA, META)
    writer.add(rows(0, 150), 0, pa.array(range(1, 151), pa.int64()))  # past one row group: written
    assert not location.exists() and len(list(tmp_path.iterdir())) == 1  # under a temporary name
    writer.abort()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="closed"):
        writer.add(rows(0, 1), 0, pa.array([1], pa.int64()))
    KeptWriter(str(tmp_path / "never.parquet"), SCHEMA, META).abort()  # nothing written: nothing to do
    assert not (tmp_path / "never.parquet").exists()


def test_the_table_appears_only_on_close_and_a_losing_writer_leaves_the_winners(tmp_path, small_groups):
    """Two submissions of one job id (nightly runs racing): both write before they know which
    opened the job; the loser aborts, the winner closes. Only close moves a table into place."""
    location = tmp_path / "kept" / "j.parquet"
    winner = KeptWriter(str(location), SCHEMA, META)
    loser = KeptWriter(str(location), SCHEMA, {**META, "unit": "other"})
    winner.add(rows(0, 150), 0, pa.array(range(1, 151), pa.int64()))
    loser.add(rows(0, 250), 0, pa.array(range(1, 251), pa.int64()))
    assert not location.exists()  # nothing visible while written
    assert winner.close() == str(location)
    loser.abort()
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == ["j.parquet"]  # no temporary left
    reader = KeptReader(str(location))
    assert reader.rows == 150 and reader.meta["unit"] == "abc"
    # a later writer's close replaces the table (a job id deleted, then submitted again)
    again = KeptWriter(str(location), SCHEMA, {**META, "unit": "again"})
    again.add(rows(0, 3), 0, pa.array(range(1, 4), pa.int64()))
    again.close()
    again.abort()  # after close: the table is the job's, abort leaves it
    assert KeptReader(str(location)).meta["unit"] == "again"
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == ["j.parquet"]


def test_reserved_names_and_mismatched_row_numbers_are_refused(tmp_path):
    with pytest.raises(ValueError, match="__row"):
        KeptWriter(str(tmp_path / "k.parquet"), pa.schema([pa.field("__row", pa.int64())]), {})
    writer = KeptWriter(str(tmp_path / "k.parquet"), SCHEMA, META)
    with pytest.raises(ValueError, match="3 kept rows but 2 row numbers"):
        writer.add(rows(0, 3), 0, pa.array([1, 2], pa.int64()))


def test_a_parquet_file_without_kept_metadata_is_not_a_kept_table(tmp_path):
    pq.write_table(pa.table({"a": [1]}), tmp_path / "x.parquet")
    with pytest.raises(ValueError, match="not a kept table"):
        KeptReader(str(tmp_path / "x.parquet"))


def test_file_uri_locations_work(tmp_path):
    location = kept_location(tmp_path.as_uri(), "job-2")
    writer = KeptWriter(location, SCHEMA, META)
    writer.add(rows(0, 5), 0, pa.array(range(1, 6), pa.int64()))
    writer.close()
    assert (tmp_path / "kept" / "job-2.parquet").is_file()
    assert KeptReader(location).rows == 5


def test_a_kept_table_in_an_object_store_appears_on_close_only(s3_server, monkeypatch):
    """s3:// file store: the table is written under a temporary key and copied into place on close."""
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    s3_server.make_bucket("files")
    location = kept_location("s3://files/store", "job-s3")
    writer = KeptWriter(location, SCHEMA, META)
    writer.add(rows(0, 5), 0, pa.array(range(1, 6), pa.int64()))
    writer._flush()  # being written (under its temporary key) now, as a large table would be
    fs = pafs.S3FileSystem(endpoint_override=s3_server.endpoint, access_key="testing", secret_key="testing",
                           region="us-east-1", scheme="http")

    def listed() -> list[str]:
        return [i.path for i in fs.get_file_info(pafs.FileSelector("files/store/kept"))]

    try:
        assert listed() == []  # an S3 upload shows nothing before it completes, and never the final key
    finally:
        writer.close()
    assert listed() == ["files/store/kept/job-s3.parquet"]
    assert KeptReader(location).rows == 5
