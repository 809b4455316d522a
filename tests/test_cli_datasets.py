"""Issue 31: the dataset options of ``submit`` / ``run`` and the ``nightly`` command, through the
CLI (click's CliRunner) on a real redis-server without daemons: bad options exit 2 before anything
is read, a folder dataset becomes one job with its kept columns, and ``nightly`` reports and exits
as ``wait`` does."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from cli_helpers import invoke

from batchinfer.cli import context as cli_context
from batchinfer.client.client import Client
from batchinfer.client.nightly import nightly_job_id, plan_nightly
from batchinfer.config import Settings
from batchinfer.datasets.manifest import Manifest, write_manifest
from batchinfer.datasets.source import DatasetSource


def _dataset(root: Path) -> Path:
    for n, date in enumerate(("2026-12-01", "2026-12-02")):
        folder = root / f"date={date}"
        folder.mkdir(parents=True)
        pq.write_table(pa.table({"id": [n * 10, n * 10 + 1], "title": ["a", "b"]}), folder / "part-0.parquet")
    return root


def _template(tmp_path: Path, text: str = "Title: {{ title }}", name: str = "t.jinja") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.fixture
def queue(redis_server, tmp_path, monkeypatch):
    """CLI arguments for a real Redis, results (and the file store) under tmp_path/results, and a
    Client on the same queue."""
    monkeypatch.setenv("BATCHINFER_RESULTS_ROOT", str(tmp_path / "results"))
    monkeypatch.delenv("BATCHINFER_OUTPUT_URI_PREFIXES", raising=False)
    args = ["--redis-url", redis_server.url, "--log-level", "WARNING"]
    with Client(settings=Settings.from_env(redis_url=redis_server.url)) as client:
        yield args, client


# -- option errors: exit 2, before anything is read ----------------------------------------------


def test_a_missing_template_file_exits_2_naming_it(tmp_path):
    missing = tmp_path / "nope.jinja"
    out = invoke("submit", str(_dataset(tmp_path / "in")), "--prompt-template", str(missing), code=2).output
    assert "--prompt-template" in out and str(missing) in out


def test_a_template_syntax_error_exits_2_naming_file_and_line(tmp_path):
    bad = _template(tmp_path, "Title: {{ title }}\n{{ body | }}\n", "bad.jinja")
    out = invoke("submit", str(_dataset(tmp_path / "in")), "--template", str(bad), code=2).output
    assert f"{bad} line 2" in out


def test_body_and_prompt_templates_exclude_each_other(tmp_path):
    t = _template(tmp_path)
    out = invoke("submit", str(tmp_path), "--prompt-template", str(t), "--body-template", str(t),
                 code=2).output
    assert "exclude each other" in out


@pytest.mark.parametrize("option, value, says", [
    ("--partition", "date", "--partition"),
    ("--where", "date = ", "--where"),
    ("--keep-columns", " , ", "--keep-columns"),
])
def test_malformed_filters_and_column_lists_exit_2(tmp_path, option, value, says):
    out = invoke("submit", str(_dataset(tmp_path / "in")), option, value, code=2).output
    assert says in out


def test_prompt_as_needs_a_prompt_template(tmp_path):
    out = invoke("submit", str(tmp_path), "--prompt-as", "prompt", code=2).output
    assert "--prompt-as" in out


def test_stdin_is_read_alone(tmp_path):
    out = invoke("submit", "-", str(tmp_path / "x.parquet"), code=2).output
    assert "stdin" in out


# -- submit a folder dataset -----------------------------------------------------------------------


def test_submit_a_folder_dataset_with_kept_columns_and_partitions(queue, tmp_path):
    args, client = queue
    root, out = _dataset(tmp_path / "in"), tmp_path / "results" / "enriched"
    job = invoke(*args, "submit", str(root), "--model", "m", "--prompt-template", str(_template(tmp_path)),
                 "--prompt-as", "prompt", "--keep-columns", "id", "--partition-by", "date",
                 "-o", str(out)).stdout.strip()
    record = client.status(job)
    assert record.total == 4
    assert record.kept is True and record.partition_by == ["date"] and record.unit
    one = invoke(*args, "submit", str(root), "--model", "m", "--template", str(_template(tmp_path)),
                 "--partition", "date=2026-12-02", "--json").stdout
    assert client.status(json.loads(one)["job_id"]).total == 2  # only that partition's rows


def test_a_folder_is_a_dataset_without_options_for_submit_and_run(queue, tmp_path):
    """`submit` and `run` agree: a folder is a dataset (its request-field columns are the requests)
    with or without dataset options, and `run` lists it before anything starts."""
    from batchinfer.cli.runner import check_input
    from batchinfer.client.inputs import InputError

    args, client = queue
    root = tmp_path / "prompts"
    for date in ("2026-12-01", "2026-12-02"):
        (root / f"date={date}").mkdir(parents=True)
        pq.write_table(pa.table({"prompt": ["a", "b", "c"]}), root / f"date={date}" / "part-0.parquet")
    job = invoke(*args, "submit", str(root), "--model", "m").stdout.strip()
    assert client.status(job).total == 6
    check_input(str(root))  # `run`: a dataset folder passes, as it does for submit
    check_input(str(root), partitions=["date=2026-12-02"])
    with pytest.raises(InputError, match="matches no file"):
        check_input(str(root), partitions=["date=2027-01-01"])  # exit 7 before a daemon starts
    out = invoke("run", str(root), "-o", str(tmp_path / "o.jsonl"), "--echo",
                 "--partition", "date=2027-01-01", code=cli_context.EXIT_INPUT).output
    assert "matches no file" in out and not (tmp_path / "o.jsonl").exists()


# -- nightly ---------------------------------------------------------------------------------------


def _nightly(args: list[str], root: Path, out: Path, template: Path, *more: str, code: int = 0):
    return invoke(*args, "nightly", "--input", str(root), "--output", str(out), "--model", "m",
                  "--template", str(template), "--keep-columns", "id", "--partition-by", "date", *more,
                  code=code)


def test_nightly_needs_a_template_and_embedded_only_flags_need_embedded(tmp_path):
    root = _dataset(tmp_path / "in")
    out = invoke("nightly", "--input", str(root), "--output", str(tmp_path / "o"), "--model", "m", code=2)
    assert "--prompt-template" in out.output
    out = _nightly([], root, tmp_path / "o", _template(tmp_path), "--echo", code=2)
    assert "--embedded" in out.output


def test_nightly_without_partition_by_exits_2(tmp_path):
    """nightly writes a dataset: without --partition-by it is refused before anything is read."""
    out = invoke("nightly", "--input", str(tmp_path / "missing"), "-o", str(tmp_path / "o"), "--model", "m",
                 "--template", str(_template(tmp_path)), "--keep-columns", "id", code=2).output
    assert "nightly writes a dataset: give --partition-by COLUMN[,..]" in out
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("option", ["--partition-by", "--keep-columns"])
def test_nightly_checks_the_columns_before_submitting(queue, tmp_path, option):
    """An unknown kept or partition column: exit 7 naming it and the input's columns, no job opened."""
    args, client = queue
    root, out = _dataset(tmp_path / "in"), tmp_path / "results" / "o"
    result = _nightly(args, root, out, _template(tmp_path), option, "country", "--timeout", "0",
                      code=cli_context.EXIT_INPUT)
    assert "country" in result.output and "columns: id, title, date" in result.output
    assert "submitted" not in result.output and client.jobs() == []


def test_nightly_embedded_checks_the_columns_before_starting_anything(tmp_path):
    """--embedded: the bad column is found before Redis, the daemons or the model start."""
    root, out = _dataset(tmp_path / "in"), tmp_path / "o"
    result = invoke("nightly", "--embedded", "--echo", "--input", str(root), "-o", str(out),
                    "--model", "demo", "--template", str(_template(tmp_path)), "--partition-by", "country",
                    "--timeout", "0", code=cli_context.EXIT_INPUT)
    assert "partition_by column(s) country are not columns" in result.output
    assert "started" not in result.output and "submitted" not in result.output


def test_nightly_refuses_an_output_the_queue_may_not_write(queue, tmp_path):
    args, _ = queue
    out = _nightly(args, _dataset(tmp_path / "in"), "s3://lake/enriched", _template(tmp_path), code=2).output
    assert "BATCHINFER_OUTPUT_URI_PREFIXES" in out


def test_nightly_exit_codes_and_report(queue, tmp_path):
    args, client = queue
    root, out, t = _dataset(tmp_path / "in"), tmp_path / "results" / "enriched", _template(tmp_path)
    # no daemons: the jobs are opened and stay open, so the wait times out (exit 6)
    waited = _nightly(args, root, out, t, "--timeout", "0", "--json", code=cli_context.EXIT_TIMEOUT)
    report = json.loads(waited.stdout)
    assert [u["action"] for u in report["units"]] == ["submitted", "submitted"]
    assert report["timed_out"] is True and report["written"] is False
    assert {u["job_id"] for u in report["units"]} == {j.id for j in client.jobs()}
    # the units' manifests written (as the exporter would): nothing to do, exit 0
    for unit in plan_nightly(DatasetSource(str(root)), str(out)).todo:
        job_id = nightly_job_id(unit, str(out))
        write_manifest(_local(), str(out), Manifest(unit=unit.unit, fingerprint=unit.fingerprint,
                                                    job_id=job_id, input=str(root), inputs=[],
                                                    outputs=[], model="m", written_at=1))
    done = _nightly(args, root, out, t).stdout.splitlines()
    assert [line.split()[:2] for line in done] == [["date=2026-12-01", "skipped"],
                                                   ["date=2026-12-02", "skipped"]]


def test_nightly_with_an_unreadable_input_exits_7(queue, tmp_path):
    args, _ = queue
    out = _nightly(args, tmp_path / "missing", tmp_path / "results" / "o", _template(tmp_path),
                   code=cli_context.EXIT_INPUT).output
    assert "missing" in out


def _local():
    import pyarrow.fs as pafs

    return pafs.LocalFileSystem()
