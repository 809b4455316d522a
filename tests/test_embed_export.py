"""Embedding rows in result files: Parquet arrays (fixed-size, mixed widths), JSONL floats, OpenAI
embeddings lines (float and base64), the nightly dataset, and the client's results path."""

from __future__ import annotations

import base64
import datetime as dt
import json
import random
import re
import uuid

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchinfer.client.client import Client
from batchinfer.config import Settings
from batchinfer.jobs import nightly
from batchinfer.jobs.export import RESULT_SCHEMA, export_job, sorted_rows
from batchinfer.jobs.formats import arrow_table, openai_line, protocol_row, result_schema
from batchinfer.jobs.output import write_rows
from batchinfer.jobs.vectors import VARIABLE_VECTOR, parquet_vector_type, vector_width
from batchinfer.keys import DIRECT, Keys
from batchinfer.protocol.rows import ResultRow, encode_vector
from batchinfer.store.jobstore import JobStatus, JobStore
from batchinfer.store.publish import Publisher
from batchinfer.workers.pooling_params import PoolingParams

PREFIX = "{emb}"
FIXED8 = pa.list_(pa.float32(), 8)


def vec(seed: int, dim: int = 8) -> np.ndarray:
    """A float32 vector whose values use every mantissa bit (so a lossy path shows)."""
    return np.random.default_rng(seed).standard_normal(dim).astype(np.float32)


def emb_row(job: str | None, idx: int | None, vectors: list[np.ndarray], *, encoding_format: str = "float",
            request_id: str | None = None) -> ResultRow:
    return ResultRow(job_id=job, request_id=request_id or f"{job}:{idx}", status="completed", idx=idx,
                     custom_id=f"e{idx}", model="minilm", prompt_tokens=4 * len(vectors), completion_tokens=0,
                     line=None if idx is None else idx + 1, finished_at=1_700_000_002_000, worker="w1",
                     url="/v1/embeddings",
                     embeddings=[encode_vector(v) for v in vectors],
                     pooling_params=PoolingParams(encoding_format=encoding_format).to_dict())


def gen_row(job: str | None, idx: int) -> ResultRow:
    return ResultRow(job_id=job, request_id=f"{job}:{idx}", status="completed", idx=idx, custom_id=f"g{idx}",
                     model="llm", finish_reason="stop", output_text=f"text {idx}", output_token_ids=[idx],
                     outputs=[{"index": 0, "text": f"text {idx}", "token_ids": [idx],
                               "finish_reason": "stop"}],
                     prompt_tokens=3, completion_tokens=1, sampling_params={"max_tokens": 1})


def publish_job(r, job: str, rows: list[ResultRow]) -> str:
    keys = Keys(PREFIX)
    JobStore(r, keys).create(job, model="minilm")
    pub = Publisher(r, keys)
    for row in random.Random(1).sample(rows, len(rows)):  # completion order is not input order
        pub.publish(row)
    pub.finish_submission(job, len(rows))
    return job


def as_bytes(values) -> bytes:
    return np.asarray(values, dtype=np.float32).tobytes()


# job rows: 0-9 single vectors of width 8, 3 a list input of three, 5 a failed row
VECTORS = {i: [vec(i)] for i in range(10) if i != 5}
VECTORS[3] = [vec(30), vec(31), vec(32)]


def embedding_job(r, job: str = "je") -> str:
    rows = [emb_row(job, i, VECTORS[i]) for i in VECTORS]
    rows.append(ResultRow.error("invalid_request", "input must not be empty", job_id=job, idx=5, line=6,
                                custom_id="e5", model="minilm", url="/v1/embeddings"))
    return publish_job(r, job, rows)


def test_parquet_embedding_columns_are_fixed_size_arrays_bit_exact(redis_server, tmp_path):
    r = redis_server.client()
    out = tmp_path / "v.parquet"
    export_job(embedding_job(r), prefix=PREFIX, output=str(out), redis_url=redis_server.url)
    table = pq.read_table(out)
    assert table.schema.equals(result_schema(FIXED8))
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), 8)  # fixed_size_list<float>[8]
    assert table.schema.field("embeddings").type == pa.list_(pa.list_(pa.float32(), 8))
    assert table.schema.names[:len(RESULT_SCHEMA)] == RESULT_SCHEMA.names  # generation columns first
    assert table.column("idx").to_pylist() == list(range(10))
    rows = table.to_pylist()
    for i, vectors in VECTORS.items():
        assert as_bytes(rows[i]["embedding"]) == vectors[0].tobytes()
        if len(vectors) == 1:
            assert rows[i]["embeddings"] is None
        else:
            assert [as_bytes(v) for v in rows[i]["embeddings"]] == [v.tobytes() for v in vectors]
        assert json.loads(rows[i]["pooling_params"])["encoding_format"] == "float"
        assert rows[i]["output_text"] is None and rows[i]["completion_tokens"] == 0
    assert rows[5]["status"] == "failed" and rows[5]["embedding"] is None and rows[5]["embeddings"] is None
    # the whole column as one [n, 8] float32 matrix (a null row's slots read back as NaN)
    matrix = table.column("embedding").combine_chunks().values.to_numpy(zero_copy_only=False).reshape(-1, 8)
    assert matrix.shape == (10, 8) and matrix[9].tobytes() == VECTORS[9][0].tobytes()
    assert np.isnan(matrix[5]).all()


def test_generation_files_keep_the_generation_schema_and_mixed_jobs_get_nulls(tmp_path):
    plain = write_rows([gen_row("j", 0).to_dict()], str(tmp_path / "g.parquet"))
    assert pq.read_schema(plain).equals(RESULT_SCHEMA)
    mixed = write_rows([gen_row("j", 0), emb_row("j", 1, [vec(1)])], str(tmp_path / "m.parquet"))
    table = pq.read_table(mixed)
    assert table.schema.field("embedding").type == FIXED8
    assert table.column("embedding").to_pylist()[0] is None
    assert table.column("output_text")[0].as_py() == "text 0"
    assert table.column("pooling_params").to_pylist()[0] is None


def test_mixed_widths_fall_back_to_variable_lists(redis_server, tmp_path):
    r = redis_server.client()
    widths = {0: 8, 1: 4, 2: 8, 3: 16}
    publish_job(r, "jw", [emb_row("jw", i, [vec(i, d)]) for i, d in widths.items()])
    out = tmp_path / "w.parquet"
    export_job("jw", prefix=PREFIX, output=str(out), redis_url=redis_server.url)
    table = pq.read_table(out)
    assert table.schema.field("embedding").type == pa.list_(pa.float32())
    assert table.schema.field("embeddings").type == pa.list_(pa.list_(pa.float32()))
    got = table.column("embedding").to_pylist()
    assert [as_bytes(v) for v in got] == [vec(i, d).tobytes() for i, d in widths.items()]


def test_the_schema_is_fixed_from_every_row_before_the_first_row_group(redis_server, tmp_path):
    r = redis_server.client()
    # embedding rows only after the first row groups: the sorting pass has seen them anyway
    rows = [gen_row("jl", i) for i in range(5)] + [emb_row("jl", 5, [vec(5)]), emb_row("jl", 6, [vec(6, 4)])]
    publish_job(r, "jl", rows)
    sorted_ = sorted_rows(r, Keys(PREFIX).results("jl"), str(tmp_path))
    assert sorted_.vector == VARIABLE_VECTOR
    out = write_rows(sorted_, str(tmp_path / "l.parquet"), row_group_rows=2, vector=sorted_.vector)
    file = pq.ParquetFile(out)
    assert file.metadata.num_row_groups == 4
    assert as_bytes(file.read().column("embedding").to_pylist()[6]) == vec(6, 4).tobytes()
    # guessing from the first row group cannot know better, and says so rather than drop vectors
    with pytest.raises(ValueError, match="started without embedding columns"):
        write_rows([x.to_dict() for x in rows], str(tmp_path / "guess.parquet"), row_group_rows=2)
    with pytest.raises(ValueError, match=r"'jl:6' has a 4-wide embedding in a file of 8-wide ones"):
        arrow_table([emb_row("jl", 5, [vec(5)]).to_dict(), emb_row("jl", 6, [vec(6, 4)]).to_dict()], FIXED8)
    assert not (tmp_path / "guess.parquet").exists()


def test_bad_vector_text_is_refused_naming_the_row():
    row = emb_row("j", 0, [vec(0)]).to_dict() | {"embeddings": ["AAAA="]}
    with pytest.raises(ValueError, match=r"result row 'j:0'.*multiple of 4"):
        arrow_table([row])
    assert vector_width(encode_vector(vec(0, 5))) == 5


def test_jsonl_has_float_vectors(redis_server, tmp_path):
    r = redis_server.client()
    out = tmp_path / "v.jsonl"
    export_job(embedding_job(r), prefix=PREFIX, output=str(out), fmt="jsonl", redis_url=redis_server.url)
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["idx"] for x in lines] == list(range(10))
    for i, vectors in VECTORS.items():
        assert all(isinstance(x, float) for x in lines[i]["embedding"])  # floats, not base64 text
        assert as_bytes(lines[i]["embedding"]) == vectors[0].tobytes()
        expected = None if len(vectors) == 1 else [v.tobytes() for v in vectors]
        assert (lines[i]["embeddings"] and [as_bytes(v) for v in lines[i]["embeddings"]]) == expected
    assert lines[5]["embedding"] is None and lines[5]["error_code"] == "invalid_request"


def test_openai_embedding_lines_float_and_base64(tmp_path):
    floats = emb_row("j", 0, [vec(0), vec(1)])
    b64 = emb_row("j", 1, [vec(2, 16)], encoding_format="base64")
    failed = ResultRow.error("invalid_request", "input must not be empty", job_id="j", idx=2, line=3,
                             custom_id="e2", url="/v1/embeddings")
    path = write_rows([floats, b64, failed], str(tmp_path / "o.jsonl"), "openai")
    with open(path) as f:
        lines = [json.loads(x) for x in f]
    first = lines[0]
    assert set(first) == {"id", "custom_id", "response", "error"} and first["error"] is None
    assert re.fullmatch(r"batch_req_[0-9a-f]{32}", first["id"]) and first["custom_id"] == "e0"
    assert set(first["response"]) == {"status_code", "request_id", "body"}
    assert first["response"]["status_code"] == 200
    assert first["id"] == f"batch_req_{first['response']['request_id']}"
    body = first["response"]["body"]
    assert set(body) == {"object", "data", "model", "usage"}
    assert body["object"] == "list" and body["model"] == "minilm"
    assert body["usage"] == {"prompt_tokens": 8, "total_tokens": 8}
    assert [(d["object"], d["index"]) for d in body["data"]] == [("embedding", 0), ("embedding", 1)]
    assert [as_bytes(d["embedding"]) for d in body["data"]] == [vec(0).tobytes(), vec(1).tobytes()]
    data = lines[1]["response"]["body"]["data"]
    assert len(data) == 1 and isinstance(data[0]["embedding"], str)
    assert base64.b64decode(data[0]["embedding"]) == vec(2, 16).astype("<f4").tobytes()
    assert lines[2]["response"] is None
    assert lines[2]["error"] == {"code": "invalid_request", "message": "line 3: input must not be empty",
                                 "line": 3}
    # the same line from a row read back out of a Parquet file (pooling_params as JSON text there)
    table = pq.read_table(write_rows([b64], str(tmp_path / "b.parquet")))
    assert json.loads(openai_line(protocol_row(table.to_pylist()[0]))) == lines[1]


def test_nightly_dataset_holds_vectors_of_several_days_and_older_files(redis_server, tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHINFER_RESULTS_ROOT", str(tmp_path))
    r = redis_server.client()
    stream = Keys(PREFIX).results(DIRECT)
    day1 = int(dt.datetime(2024, 6, 1, 12, tzinfo=dt.timezone.utc).timestamp() * 1000)
    day2 = day1 + nightly.DAY_MS
    rows = {day1: emb_row(None, None, [vec(1)], request_id="d1"),  # width 8 on day 1
            day1 + 1: ResultRow(job_id=None, request_id="d2", status="completed", output_text="hi"),
            day2: emb_row(None, None, [vec(3, 4), vec(4, 4)], request_id="d3")}  # width 4, a list, day 2
    for ms, row in rows.items():
        r.xadd(stream, {"row": row.to_json()}, id=f"{ms}-0")
    # a partition written before the embedding columns existed: the generation schema only
    old = tmp_path / "direct" / "date=2024-05-31" / f"part-0-{day1 - nightly.DAY_MS}.parquet"
    write_rows([ResultRow(job_id=None, request_id="d0", status="completed", output_text="old")], str(old),
               vector=None)
    written = nightly.export_direct(prefix=PREFIX, until_ms=day2 + nightly.DAY_MS // 2,
                                    redis_url=redis_server.url)
    assert len(written) == 2
    assert all(pq.read_schema(f).equals(nightly.DIRECT_FILE_SCHEMA) for f in written)
    table = nightly.read_direct(prefix=PREFIX).sort_by("request_id")
    assert table.schema.field("embedding").type == pa.list_(pa.float32())
    got = dict(zip(table.column("request_id").to_pylist(), table.to_pylist(), strict=True))
    assert got["d0"]["embedding"] is None and got["d0"]["output_text"] == "old"
    assert as_bytes(got["d1"]["embedding"]) == vec(1).tobytes() and got["d1"]["embeddings"] is None
    assert got["d2"]["embedding"] is None
    assert [as_bytes(v) for v in got["d3"]["embeddings"]] == [vec(3, 4).tobytes(), vec(4, 4).tobytes()]
    assert got["d3"]["date"] == dt.date(2024, 6, 2)


def test_client_results_and_files_of_an_embedding_job(redis_session, tmp_path):
    settings = Settings(redis_url=redis_session.url, prefix=f"{{c{uuid.uuid4().hex[:8]}}}")
    client = Client(settings=settings)
    try:
        job = "jc"
        JobStore(client.redis, client.keys).create(job, model="minilm")
        pub = Publisher(client.redis, client.keys)
        for i in (2, 0, 1):
            pub.publish(emb_row(job, i, [vec(i)] if i != 1 else [vec(10), vec(11)]))
        pub.finish_submission(job, 3)
        df = client.results(job)
        assert df["embedding"].map(as_bytes).tolist() == [vec(i).tobytes() for i in (0, 10, 2)]
        from_stream = client.write_results(job, str(tmp_path / "a.parquet"))
        assert pq.read_schema(from_stream).field("embedding").type == FIXED8
        assert parquet_vector_type("file://" + from_stream) == FIXED8
        assert parquet_vector_type(write_rows([gen_row(job, 0)], str(tmp_path / "g.parquet"))) is None
        client.redis.delete(client.keys.results(job))  # as after the results TTL: read the exported file
        client.store.set_status(job, JobStatus.COMPLETED, output=from_stream)
        assert [ResultRow.from_dict(x).vectors() for x in client.result_rows(job)][1] == [
            vec(10).tolist(), vec(11).tolist()]
        from_file = client.write_results(job, str(tmp_path / "b.parquet"))
        assert pq.read_table(from_file).equals(pq.read_table(from_stream))
        lines = client.write_results(job, str(tmp_path / "b.jsonl"), fmt="jsonl")
        with open(lines) as f:
            assert as_bytes(json.loads(f.readline())["embedding"]) == vec(0).tobytes()
    finally:
        client.close()


def test_show_results_prints_an_embeddings_file(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "examples" / "show_results.py"
    near = vec(0) + np.float32(0.01) * vec(5)
    rows = [emb_row("j", 0, [vec(0)]), emb_row("j", 1, [near]), emb_row("j", 2, [vec(2), vec(3)]),
            ResultRow.error("invalid_request", "input must not be empty", job_id="j", idx=3, custom_id="e3"),
            gen_row("j", 4)]
    for name, fmt in (("s.parquet", "parquet"), ("s.jsonl", "jsonl")):
        path = write_rows(rows, str(tmp_path / name), fmt)
        done = subprocess.run([sys.executable, str(script), path], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert f"dim 8: [{vec(0)[0]:.4f}, " in done.stdout and "[invalid_request]" in done.stdout
        assert "text 4" in done.stdout
        assert "e0                   nearest e1" in done.stdout  # the near copy, not e2
