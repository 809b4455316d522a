"""The export in bounded memory (issue 27): the results stream read in chunks, ordered by an
external merge sort, written a bounded row group at a time, and the files the same as ever."""

from __future__ import annotations

import json
import random
import tracemalloc

import pyarrow.parquet as pq
import pytest

from batchinfer.jobs import output
from batchinfer.jobs.export import export_job
from batchinfer.jobs.output import write_rows
from batchinfer.keys import Keys
from batchinfer.protocol.rows import ResultRow
from batchinfer.store.jobstore import JobStore
from batchinfer.store.publish import Publisher

PREFIX = "{m}"


def _row(job_id: str, idx: int, text: str) -> ResultRow:
    if idx % 11 == 3:
        return ResultRow.error("engine_error", f"request {idx} failed", status="failed", job_id=job_id,
                               idx=idx, custom_id=f"c{idx}", model="m")
    tokens = [idx % 5 + 1, 2]
    return ResultRow(job_id=job_id, request_id=f"{job_id}:{idx}", status="completed", idx=idx,
                     custom_id=f"c{idx}", model="m", finish_reason="length", output_text=text,
                     output_token_ids=tokens,
                     outputs=[{"index": 0, "text": text, "token_ids": tokens, "finish_reason": "length"}],
                     prompt_tokens=4, completion_tokens=2, cached_tokens=0, line=idx + 1,
                     created_at=1_700_000_000_000, started_at=1_700_000_001_000,
                     finished_at=1_700_000_002_000,
                     worker="w1", sampling_params={"max_tokens": 2}, metadata={"k": str(idx)})


def _job(r, n: int, *, text_bytes: int = 8, job_id: str = "job1",
         duplicates: tuple[int, ...] = ()) -> list[dict]:
    """A finalizing job of ``n`` rows published in a shuffled order, then raw later copies of the
    ``duplicates`` (other text: the export keeps the first); its rows as the export should write them."""
    keys = Keys(PREFIX)
    JobStore(r, keys).create(job_id, model="m")
    pub = Publisher(r, keys)
    rows = [_row(job_id, i, f"text {i} ".ljust(text_bytes, "x")) for i in range(n)]
    order = list(range(n))
    random.Random(1).shuffle(order)
    for i in order:
        pub.publish(rows[i])
    for i in duplicates:
        later = {**rows[i].to_dict(), "output_text": "a later copy"}
        r.xadd(keys.results(job_id), {"row": json.dumps(later)})
    pub.finish_submission(job_id, n)
    return [json.loads(json.dumps(row.to_dict())) for row in rows]


def _xrange_calls(r) -> int:
    return r.info("commandstats").get("cmdstat_xrange", {}).get("calls", 0)


@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "openai"])
def test_small_chunks_and_runs_give_the_same_file(redis_server, tmp_path, fmt):
    r = redis_server.client()
    expected = _job(r, 60, duplicates=(5, 41))
    reference = write_rows(expected, str(tmp_path / f"ref.{fmt}"), fmt, vector=None)  # all rows at once
    # 7 entries per XRANGE, a sorted run per row (about 60 runs merged), and the defaults
    small = export_job("job1", prefix=PREFIX, output=str(tmp_path / f"small.{fmt}"), fmt=fmt,
                       redis_url=redis_server.url, chunk_rows=7, run_bytes=1)
    default = export_job("job1", prefix=PREFIX, output=str(tmp_path / f"default.{fmt}"), fmt=fmt,
                         redis_url=redis_server.url)
    if fmt == "parquet":
        ref = pq.read_table(reference)
        for path in (small, default):
            table = pq.read_table(path)
            assert table.schema.equals(ref.schema) and table.equals(ref)
            assert pq.ParquetFile(path).metadata.num_row_groups == 1
        assert ref.column("idx").to_pylist() == list(range(60))
        assert ref.column("output_text").to_pylist()[5] == "text 5 x"  # the first copy, not the later one
    else:
        text = (tmp_path / f"ref.{fmt}").read_text()
        assert (tmp_path / f"small.{fmt}").read_text() == text
        assert (tmp_path / f"default.{fmt}").read_text() == text
        assert len(text.splitlines()) == 60 and "a later copy" not in text


def test_the_stream_is_read_chunk_rows_entries_at_a_time(redis_server, tmp_path):
    r = redis_server.client()
    _job(r, 50)
    calls = []
    for chunk_rows in (7, 10, 1000):
        before = _xrange_calls(r)
        export_job("job1", prefix=PREFIX, output=str(tmp_path / f"{chunk_rows}.parquet"),
                   redis_url=redis_server.url, chunk_rows=chunk_rows)
        calls.append(_xrange_calls(r) - before)
    # one XRANGE per full chunk, and one that comes back short; with room for 1000 (after a first
    # read of a few entries of unknown size) the 50 rows take fewer
    assert calls[:2] == [50 // 7 + 1, 50 // 10 + 1] and calls[2] < calls[1]


def test_the_export_holds_a_bounded_part_of_the_rows(redis_server, tmp_path, monkeypatch):
    """Python memory the export allocates stays well under the rows' size (the earlier export held
    every row's JSON and then up to 65,536 rows as dicts)."""
    r = redis_server.client()
    n = 1500
    _job(r, n, text_bytes=8192)
    json_bytes = sum(len(f[b"row"]) for _, f in r.xrange(Keys(PREFIX).results("job1")))
    assert json_bytes > 12 << 20
    monkeypatch.setattr(output, "ROW_GROUP_BYTES", 1 << 20)
    _job(r, 3, job_id="warm")  # an export first, untraced: the modules it imports on first use
    export_job("warm", prefix=PREFIX, output=str(tmp_path / "warm.parquet"), redis_url=redis_server.url)
    tracemalloc.start()
    try:
        location = export_job("job1", prefix=PREFIX, output=str(tmp_path / "big.parquet"),
                              redis_url=redis_server.url, run_bytes=1 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    table = pq.read_table(location, columns=["idx"])
    assert table.column("idx").to_pylist() == list(range(n))
    assert peak < json_bytes / 3, f"the export's Python peak was {peak} bytes for {json_bytes} bytes of rows"


def test_row_groups_are_bounded_by_bytes_as_well_as_rows(tmp_path, monkeypatch):
    rows = [_row("j", i, f"text {i} ".ljust(4096, "x")).to_dict() for i in range(300)]
    # by rows, as before: full groups of row_group_rows
    path = write_rows(rows, str(tmp_path / "by_rows.parquet"), row_group_rows=70, vector=None)
    meta = pq.ParquetFile(path).metadata
    assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == [70, 70, 70, 70, 20]
    # by bytes: rows of ~4 KiB, groups of about 64 KiB of Arrow data
    monkeypatch.setattr(output, "ROW_GROUP_BYTES", 64 << 10)
    path = write_rows(rows, str(tmp_path / "by_bytes.parquet"), row_group_rows=70, vector=None)
    meta = pq.ParquetFile(path).metadata
    sizes = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
    assert sum(sizes) == 300 and len(sizes) > 300 // 70 + 1 and max(sizes) <= 16, sizes
    assert pq.read_table(path).equals(pq.read_table(tmp_path / "by_rows.parquet"))
