"""``Client.submit`` over datasets against a real redis-server: templates, kept columns, filters.

No daemon runs: the intake stream's entries and the error rows the client publishes itself are
read back directly, and the kept table from the file store.
"""

from __future__ import annotations

import json
import uuid

import pandas as pd
import polars as pl
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest

from batchinfer.client.client import Client
from batchinfer.client.inputs import InputError, dataset_lines
from batchinfer.config import Settings
from batchinfer.datasets import source as source_module
from batchinfer.datasets.kept import FILE_COLUMN, ROW_COLUMN, KeptReader, kept_location
from batchinfer.datasets.manifest import unit_id
from batchinfer.datasets.source import DatasetSource
from batchinfer.datasets.templates import RequestTemplate
from batchinfer.protocol.entries import IntakeEntry, JobOp, RequestError
from batchinfer.store.registry import Registry

DAYS = ("2026-12-01", "2026-12-02", "2026-12-03")
ROWS_PER_FILE = 7


@pytest.fixture
def client(redis_session, tmp_path):
    settings = Settings(redis_url=redis_session.url, prefix=f"{{t{uuid.uuid4().hex[:8]}}}",
                        results_root=str(tmp_path / "results"), files_dir=str(tmp_path / "files"))
    c = Client(settings=settings)
    yield c
    c.close()


@pytest.fixture
def events(tmp_path):
    """A Hive dataset: date=<day>/part-0.parquet, 7 rows each; every 4th title is null."""
    root = tmp_path / "events"
    for d, day in enumerate(DAYS):
        ids = [d * 100 + i for i in range(ROWS_PER_FILE)]
        table = pa.table({
            "id": pa.array(ids, pa.int64()),
            "title": [None if i % 4 == 3 else f"title {n}" for i, n in enumerate(ids)],
            "lang": ["en", "fr", "de", "en", "fr", "de", "en"],
            "score": pa.array([1.5 * i for i in range(ROWS_PER_FILE)], pa.float32()),
        })
        (root / f"date={day}").mkdir(parents=True)
        pq.write_table(table, root / f"date={day}" / "part-0.parquet")
    return root


def intake(client: Client) -> list[IntakeEntry]:
    entries = client.redis.xrange(client.keys.requests)
    return [IntakeEntry.from_fields(f) for _, f in entries if b"op" not in f]


def opened(client: Client) -> JobOp:
    return next(JobOp.from_fields(f) for _, f in client.redis.xrange(client.keys.requests)
                if f.get(b"op") == b"open")


TEMPLATE = "Title: {{ title }}\nLang: {{ lang }}"


def test_template_rows_become_bodies_error_rows_and_kept_rows(client, events):
    template = RequestTemplate.from_text(TEMPLATE, name="t.jinja")
    job = client.submit(events, "m", template=template, keep_columns=["id", "date", "score"])
    record = client.status(job)
    assert record.total == len(DAYS) * ROWS_PER_FILE
    entries = intake(client)
    sent = {e.idx: e for e in entries}
    errors = {r["idx"]: r for r in client.result_rows(job)}
    assert sorted([*sent, *errors]) == list(range(record.total))  # one idx per row, nothing twice
    for idx in range(record.total):
        d, i = divmod(idx, ROWS_PER_FILE)  # files in order, rows in file order
        location = str(events / f"date={DAYS[d]}" / "part-0.parquet")
        if i % 4 == 3:
            row = errors[idx]
            assert row["error_code"] == "invalid_request" and row["line"] == i + 1
            assert row["error_message"] == (f"{location} row {i + 1}: t.jinja line 1: column 'title' is null "
                                            "(use `title | default(...)` or `is defined` where a null is "
                                            "expected)")
        else:
            entry = sent[idx]
            assert entry.line == i + 1 and entry.job_id == job
            lang = ["en", "fr", "de", "en", "fr", "de", "en"][i]
            # no model registered: a chat model is assumed
            assert json.loads(entry.body) == {"messages": [
                {"role": "user", "content": f"Title: title {d * 100 + i}\nLang: {lang}"}]}
    op = opened(client)
    assert op.params["kept"] is True and op.params.get("partition_by") is None
    assert op.params["unit"] == unit_id([str(events), *(f"date={day}/part-0.parquet" for day in DAYS)])
    assert op.params["input_name"] == "events"
    reader = KeptReader(kept_location(client.settings.files_root(), job))
    source_schema = DatasetSource(events).schema
    assert reader.schema == pa.schema([source_schema.field(c) for c in ("id", "date", "score")])
    assert reader.schema.field("score").type == pa.float32()
    kept = pa.Table.from_batches(list(reader.batches()))
    assert kept.num_rows == record.total
    assert kept.column("id").to_pylist() == [d * 100 + i for d in range(3) for i in range(ROWS_PER_FILE)]
    assert kept.column(ROW_COLUMN).to_pylist() == list(range(1, ROWS_PER_FILE + 1)) * 3
    assert kept.column(FILE_COLUMN).to_pylist() == [d for d in range(3) for _ in range(ROWS_PER_FILE)]
    assert [f["relative"] for f in reader.meta["files"]] == [f"date={day}/part-0.parquet" for day in DAYS]
    assert reader.meta["keep_columns"] == ["id", "date", "score"] and reader.meta["input"] == str(events)


def test_filters_restrict_what_is_sent_and_keep_row_numbers(client, events):
    template = RequestTemplate.from_text("{{ id }}", prompt_as="prompt")
    job = client.submit(events, template=template, keep_columns=["id"], partitions=[f"date={DAYS[1]}"],
                        where="id >= 103 AND lang <> 'de'")
    entries = intake(client)
    assert [(json.loads(e.body)["prompt"], e.line) for e in entries] == [("103", 4), ("104", 5), ("106", 7)]
    assert client.status(job).total == 3
    kept = pa.Table.from_batches(list(KeptReader(kept_location(client.settings.files_root(), job)).batches()))
    assert kept.column("id").to_pylist() == [103, 104, 106]
    assert kept.column(ROW_COLUMN).to_pylist() == [4, 5, 7]
    assert opened(client).params["unit"] == unit_id([str(events), f"date={DAYS[1]}/part-0.parquet"])


def test_a_filter_that_leaves_no_row_creates_no_job(client, events, tmp_path):
    template = RequestTemplate.from_text("{{ id }}", prompt_as="prompt")
    with pytest.raises(InputError, match="no requests"):
        client.submit(events, template=template, keep_columns=["id"], where="id > 100000")
    with pytest.raises(InputError, match="matches no file"):
        client.submit(events, template=template, partitions=["date=2030-01-01"])
    assert client.jobs() == []
    assert list((tmp_path / "files").rglob("*.parquet")) == []  # no kept table left behind


def test_clashing_and_unknown_columns_are_refused_before_a_job_exists(client, events, tmp_path):
    template = RequestTemplate.from_text("{{ id }}", prompt_as="prompt")
    table = pa.table({"id": [1], "status": ["new"], "model": ["x"], "__row": [1], "url": ["u"]})
    # `url` is no Parquet result column, but a JSONL line's key (the row's own field)
    with pytest.raises(InputError, match=r"keep column\(s\) status, model, __row, url clash with result"):
        client.submit(table, template=template, keep_columns=["id", "status", "model", "__row", "url"])
    with pytest.raises(InputError, match=r"partition_by column\(s\) country are not columns"):
        client.submit(events, template=template, partition_by=["country"],
                      output=str(tmp_path / "results" / "out"))
    with pytest.raises(InputError, match=r"keep column\(s\) nope are not columns"):
        client.submit(events, template=template, keep_columns=["nope"])
    with pytest.raises(RequestError, match="partition_by needs an output"):
        client.submit(events, template=template, partition_by=["date"])
    assert client.jobs() == []
    assert not (tmp_path / "files").exists()  # no kept table was left


def test_partition_by_keeps_its_columns_and_goes_in_the_open(client, events, tmp_path):
    out = tmp_path / "results" / "enriched"
    job = client.submit(events, "m", template=RequestTemplate.from_text(TEMPLATE, prompt_as="prompt"),
                        keep_columns=["id"], partition_by=["date"], output=str(out), unit="nightly-1")
    op = opened(client)
    assert op.params["partition_by"] == ["date"] and op.params["unit"] == "nightly-1"
    reader = KeptReader(kept_location(client.settings.files_root(), job))
    assert reader.schema.names == ["id", "date"] and reader.meta["partition_by"] == ["date"]
    assert reader.meta["unit"] == "nightly-1"
    assert reader.rows == client.status(job).total


def test_body_template_and_an_invalid_body_are_per_row(client, tmp_path):
    df = pd.DataFrame({"q": ["a", "b\"c", None], "n": [1, 2, 3]})
    template = RequestTemplate.from_text(
        '{"messages": [{"role": "user", "content": {{ q | tojson }}}], "max_tokens": {{ n }}}', "body",
        name="b.jinja")
    job = client.submit(df, "m", template=template)
    bodies = [json.loads(e.body) for e in intake(client)]
    assert bodies == [{"messages": [{"role": "user", "content": "a"}], "max_tokens": 1},
                      {"messages": [{"role": "user", "content": 'b"c'}], "max_tokens": 2}]
    (error,) = client.result_rows(job)
    assert error["idx"] == 2 and error["line"] == 3
    assert error["error_message"].startswith("<dataframe> row 3: b.jinja line 1: column 'q' is null")
    assert opened(client).params.get("kept") is not True  # nothing kept: no kept table
    assert not (tmp_path / "files").exists()


def test_polars_and_request_columns_without_template(client):
    df = pl.DataFrame({"prompt": ["x", "y"], "max_tokens": [3, None], "doc_id": ["d1", "d2"]})
    job = client.submit(df, "m", keep_columns=["doc_id"])
    assert [json.loads(e.body) for e in intake(client)] == [{"prompt": "x", "max_tokens": 3}, {"prompt": "y"}]
    kept = pa.Table.from_batches(list(KeptReader(kept_location(client.settings.files_root(), job)).batches()))
    assert kept.column("doc_id").to_pylist() == ["d1", "d2"]
    assert opened(client).params["input_name"] == "<dataframe>"
    with pytest.raises(InputError, match="doc_id are not request fields"):  # not kept: not a request field
        client.submit(df, "m", job_id="other", where="max_tokens > 0")


def test_a_pyarrow_dataset_and_table_are_datasets(client, events):
    template = RequestTemplate.from_text("{{ title | default('-') }}", prompt_as="prompt")
    client.submit(pads.dataset(events, partitioning="hive"), template=template, job_id="ds")
    assert len(intake(client)) == 3 * ROWS_PER_FILE
    client.submit(pa.table({"title": ["only"]}), template=template, job_id="tb")
    assert json.loads(intake(client)[-1].body) == {"prompt": "only"}
    assert client.status("tb").input_name == "<table>"


def test_prompt_as_auto_follows_the_model_registration(client):
    registry = Registry(client.redis, client.keys)
    capacity = {"max_model_len": 64, "max_num_seqs": 2, "max_num_batched_tokens": 64, "kv_tokens": 64}
    tok = b'{"model": {}}'
    registry.register_model("chat", {"tokenizer.json": tok, "tokenizer_config.json":
                                     json.dumps({"chat_template": "{{ messages }}"}).encode()}, capacity)
    registry.register_model("chat2", {"tokenizer.json": tok, "chat_template.jinja": b"{{ messages }}"},
                            capacity)
    registry.register_model("base", {"tokenizer.json": tok, "tokenizer_config.json": b"{}"}, capacity)
    registry.register_model("emb", {"tokenizer.json": tok}, capacity, task="embed", embedding_dim=8)
    expected = {"chat": "messages", "chat2": "messages", "base": "prompt", "emb": "input",
                "unknown": "messages"}
    assert {name: client.prompt_as(name) for name in expected} == expected
    template = RequestTemplate.from_text("{{ t }}")
    for name, field in [("base", "prompt"), ("emb", "input")]:
        client.submit(pa.table({"t": ["hello"]}), name, template=template, job_id=f"j-{name}")
        assert field in json.loads(intake(client)[-1].body)


def test_a_failed_submission_cancels_the_job_and_drops_the_kept_table(client, events, tmp_path, monkeypatch):
    monkeypatch.setattr("batchinfer.datasets.kept._ROW_GROUP_ROWS", 2)  # the file exists before it fails
    client.settings.max_requests_per_job = 5
    template = RequestTemplate.from_text("{{ id }}", prompt_as="prompt")
    with pytest.raises(ValueError, match="more than 5 requests"):
        client.submit(events, template=template, keep_columns=["id"], job_id="big")
    assert client.status("big").status.value in ("cancelling", "cancelled")
    assert [p for p in (tmp_path / "files").rglob("*") if p.is_file()] == []  # no temporary either


def test_a_second_submission_of_a_job_id_leaves_the_first_ones_kept_table(client, events, tmp_path,
                                                                          monkeypatch):
    """The nightly planner's ids are deterministic: a run that loses the open (the job exists) has
    written its own kept rows by then, and must neither replace nor delete the winner's table."""
    monkeypatch.setattr("batchinfer.datasets.kept._ROW_GROUP_ROWS", 2)  # rows written before the open
    template = RequestTemplate.from_text("{{ id }}", prompt_as="prompt")
    job = client.submit(events, template=template, keep_columns=["id"], job_id="nightly-x")
    location = kept_location(client.settings.files_root(), job)
    first_rows = pa.Table.from_batches(list(KeptReader(location).batches())).to_pylist()
    with pytest.raises(ValueError, match="already exists"):
        client.submit(events, template=template, keep_columns=["id", "lang"], where="date = '2026-12-02'",
                      job_id="nightly-x")
    again = KeptReader(location)
    assert again.schema.names == ["id"]
    assert pa.Table.from_batches(list(again.batches())).to_pylist() == first_rows
    assert [p.name for p in (tmp_path / "files").rglob("*") if p.is_file()] == ["nightly-x.parquet"]


def test_dataset_lines_reads_only_the_columns_it_needs(events, monkeypatch):
    asked = []
    scan = source_module.DatasetSource.scan

    def spy(self, columns=None, batch_rows=4096):
        asked.append(list(columns))
        return scan(self, columns, batch_rows)

    monkeypatch.setattr(source_module.DatasetSource, "scan", spy)
    template = RequestTemplate.from_text("{{ title | default('') }}{{ missing | default('') }}",
                                         prompt_as="prompt")
    lines = list(dataset_lines(DatasetSource(events), template=template, keep_columns=["id"]))
    assert asked == [["id", "title"]]  # neither lang nor score nor the partition key
    assert len(lines) == 3 * ROWS_PER_FILE and all(line.body for line in lines)


def test_a_template_variable_that_is_no_column_fails_each_row_naming_the_columns(client, events):
    template = RequestTemplate.from_text("{{ titel }}", name="t.jinja", prompt_as="prompt")
    job = client.submit([events / f"date={DAYS[0]}" / "part-0.parquet"], template=template)  # a list of files
    rows = list(client.result_rows(job))
    assert len(rows) == ROWS_PER_FILE and intake(client) == []
    location = events / f"date={DAYS[0]}" / "part-0.parquet"
    assert rows[0]["error_message"] == (f"{location} row 1: t.jinja line 1: no column 'titel' "
                                        "(columns: id, lang, score, title)")


def test_input_column_and_kept_columns_without_a_template(client):
    table = pa.table({"text": ["a", "b"], "doc": [7, 8], "dimensions": [4, None]})
    job = client.submit(table, "emb", input_column="text", keep_columns=["doc"])
    assert [json.loads(e.body) for e in intake(client)] == [{"input": "a", "dimensions": 4}, {"input": "b"}]
    assert KeptReader(kept_location(client.settings.files_root(), job)).schema.names == ["doc"]


def test_what_reads_as_a_dataset(events, tmp_path):
    from batchinfer.client.inputs import is_dataset

    single = tmp_path / "one.parquet"
    assert is_dataset(events) and is_dataset(str(events)) and is_dataset(f"{events}/*/*.parquet")
    assert is_dataset("s3://bucket/events/") and is_dataset([single, single]) and is_dataset([str(single)])
    assert is_dataset(pa.table({"a": [1]})) and is_dataset(pl.DataFrame({"a": [1]}))
    assert is_dataset(pads.dataset(events)) and is_dataset(DatasetSource(events))
    assert not is_dataset(str(single)) and not is_dataset("-") and not is_dataset(pd.DataFrame({"a": [1]}))
    assert not is_dataset([{"prompt": "x"}]) and not is_dataset(['{"prompt": "x"}']) and not is_dataset([])
