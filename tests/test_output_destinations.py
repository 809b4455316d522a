"""Issue 27, item 2: a producer names a job's output only inside the operator's destinations
(``BATCHINFER_RESULTS_ROOT`` and ``BATCHINFER_OUTPUT_URI_PREFIXES``), and an export never replaces
a file its job did not write. Checked where the value arrives (client / CLI ``submit``, the
scheduler's ``op open``) and again in the exporter, against a real redis-server."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from daemons import CLI, JOB_TIMEOUT_S

from batchinfer.cli.context import EXIT_USAGE
from batchinfer.cli.main import cli
from batchinfer.client.client import Client
from batchinfer.config import Settings
from batchinfer.jobs.export import export_job
from batchinfer.keys import DIRECT, Keys
from batchinfer.protocol.destinations import check_output, parse_prefixes
from batchinfer.protocol.rows import ResultRow
from batchinfer.scheduler.daemon import SchedulerDaemon
from batchinfer.store.jobstore import JobField, JobStatus, JobStore
from batchinfer.store.publish import Publisher

PREFIX = "{dst}"
KEYS = Keys(PREFIX)
HOSTILE_S3 = "s3://a:b@bucket/x?endpoint_override=127.0.0.1:9998&scheme=http"  # the issue's, verbatim
VICTIM_TEXT = "the operator's file\n"


@pytest.fixture
def places(tmp_path: Path) -> tuple[Path, Path]:
    """The results root, and a folder outside it holding a file nobody may replace."""
    root, outside = tmp_path / "results", tmp_path / "srv"
    root.mkdir()
    outside.mkdir()
    (outside / "victim.txt").write_text(VICTIM_TEXT)
    return root, outside


# -- the rule -----------------------------------------------------------------------------------------------


def test_file_uris_are_refused_by_default_and_allowed_under_a_configured_prefix(places):
    root, outside = places
    victim = (outside / "victim.txt").as_uri()
    with pytest.raises(ValueError, match="not an allowed destination.*none are set"):
        check_output(victim, str(root))
    with pytest.raises(ValueError, match="outside the results folder"):
        check_output(str(outside / "victim.txt"), str(root))  # the same file as a plain path
    assert check_output((root / "a" / "x.parquet").as_uri(), str(root))  # a file:// URI inside the root
    assert check_output("a/x.parquet", str(root)) == "a/x.parquet"
    allowed = outside.as_uri()
    assert check_output(victim, str(root), allowed) == victim
    assert check_output((outside / "sub" / "y.parquet").as_uri(), str(root), f"s3://other/x, {allowed}")


def test_a_prefix_allows_only_what_is_below_it_at_a_path_boundary(places):
    root, _ = places
    allowed = "s3://bucket/out,gs://data/results/"
    for ok in ("s3://bucket/out/x.parquet", "s3://bucket/out/team/x.parquet", "S3://bucket/out/x.parquet",
               "gs://data/results/x.jsonl"):
        assert check_output(ok, str(root), allowed) == ok
    for bad in ("s3://bucket/outside/x.parquet", "s3://bucket/out.parquet", "s3://bucket.evil/out/x",
                "s3://bucket:9000/out/x", "s3://bucket/x.parquet", "gs://data/resultsX/x", "hdfs://bucket/out/x",
                "s3://bucket/Out/x.parquet"):
        with pytest.raises(ValueError, match="not an allowed destination"):
            check_output(bad, str(root), allowed)


@pytest.mark.parametrize(("output", "why"), [
    ("s3://bucket/out/x?endpoint_override=127.0.0.1:9998", "query string"),
    ("s3://bucket/out/x?", "query string"),
    ("s3://key:secret@bucket/out/x", "credentials"),
    ("s3://key@bucket/out/x", "credentials"),
    ("s3://bucket/out/../x", r"'\.\.' path segments"),
    ("s3://bucket/out/%2e%2e/x", r"'\.\.' path segments"),
    ("s3://bucket/out/a%2F..%2Fb", r"'\.\.' path segments"),
    ("s3://bucket/out/x#frag", "fragment"),
    ("s3://bucket/out/x\n", "control character"),
])
def test_queries_credentials_and_dot_dot_are_refused_even_under_an_allowed_prefix(places, output, why):
    root, _ = places
    with pytest.raises(ValueError, match=why):
        check_output(output, str(root), "s3://bucket/out")


def test_the_issue_s_outputs_are_refused_and_no_secret_is_echoed(places):
    root, outside = places
    with pytest.raises(ValueError) as refused:
        check_output(HOSTILE_S3, str(root), "s3://bucket")
    assert "a:b@" not in str(refused.value) and "***@bucket" in str(refused.value)
    with pytest.raises(ValueError, match=r"'\.\.' path segments"):  # pyarrow decodes %2e%2e to ..
        check_output(outside.as_uri() + "/%2e%2e/escape.txt", str(root), outside.as_uri())
    (outside / "link").symlink_to(root.parent)  # a symlink out of an allowed folder
    with pytest.raises(ValueError, match="leaves"):
        check_output((outside / "link" / "z.parquet").as_uri(), str(root), outside.as_uri())
    with pytest.raises(ValueError, match="leaves"):  # file://host/... is not a local path
        check_output("file://host.example" + str(outside / "v.parquet"), str(root), "file://host.example/")


def test_the_allow_list_setting(monkeypatch):
    monkeypatch.setenv("BATCHINFER_OUTPUT_URI_PREFIXES", "s3://bucket/out, file:///srv/results/,")
    settings = Settings.from_env()
    assert parse_prefixes(settings.output_uri_prefixes) == ("s3://bucket/out", "file:///srv/results/")
    assert Settings().output_uri_prefixes == "" and parse_prefixes("") == ()
    for bad in ("/srv/results", "s3://bucket/out?endpoint_override=x", "s3://k:s@bucket/"):
        with pytest.raises(ValueError, match="BATCHINFER_OUTPUT_URI_PREFIXES"):
            parse_prefixes(bad)


# -- where a producer's value arrives ---------------------------------------------------------------------


def test_submit_refuses_a_foreign_destination_before_anything_is_queued(redis_server, places, tmp_path):
    root, outside = places
    client = Client(settings=Settings(redis_url=redis_server.url, prefix=PREFIX, results_root=str(root)))
    f = tmp_path / "in.jsonl"
    f.write_text('{"prompt": "a"}\n')
    for bad in ((outside / "victim.txt").as_uri(), HOSTILE_S3):
        with pytest.raises(ValueError, match="not an allowed destination|query string"):
            client.submit(f, model="m", output=bad)
    args = ["--redis-url", redis_server.url, "--prefix", PREFIX, "submit", str(f), "--output",
            (outside / "victim.txt").as_uri()]
    result = CliRunner(env={"BATCHINFER_RESULTS_ROOT": str(root)}).invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == EXIT_USAGE and "not an allowed destination" in result.output
    assert client.jobs() == [] and (outside / "victim.txt").read_text() == VICTIM_TEXT


def test_op_open_with_a_hostile_output_is_an_invalid_request_row_and_opens_no_job(redis_server, places):
    root, outside = places
    r = redis_server.client()
    victim = (outside / "victim.txt").as_uri()
    for job, output in (("j-file", victim), ("j-s3", HOSTILE_S3), ("j-up", "../srv/victim.txt")):
        r.xadd(KEYS.requests, {"v": "1", "op": "open", "job": job, "output": output,
                               "reply_to": KEYS.reply(job)})
        r.xadd(KEYS.requests, {"v": "1", "op": "close", "job": job, "total": "1"})
    r.xadd(KEYS.requests, {"v": "1", "op": "open", "job": "j-ok", "output": "team/ok.parquet"})
    sched = SchedulerDaemon(r, Settings(prefix=PREFIX, results_root=str(root)))
    while sched.run_once():
        pass
    direct = [ResultRow.from_json(f[b"row"]) for _, f in r.xrange(KEYS.results(DIRECT))]
    refused = [row for row in direct if row.error_code == "invalid_request"]
    assert len(refused) == 3, [(row.error_code, row.error_message) for row in direct]
    assert all(row.error_message.startswith("output ") for row in refused)
    assert "a:b@" not in json.dumps([row.error_message for row in direct])
    for job in ("j-file", "j-s3", "j-up"):
        assert not r.exists(KEYS.job(job)) and not r.exists(KEYS.results(job))
        [reply] = [ResultRow.from_json(f[b"row"]) for _, f in r.xrange(KEYS.reply(job))]
        assert reply.error_code == "invalid_request"
    assert JobStore(r, KEYS).get("j-ok").output == "team/ok.parquet"  # an allowed one opens its job
    assert (outside / "victim.txt").read_text() == VICTIM_TEXT and list(root.iterdir()) == []


# -- the exporter -------------------------------------------------------------------------------------------


def _finished_job(r, job: str, output: str | None, n: int = 2, text: str = "row") -> None:
    """A record written directly (an older build, or by hand) and its rows: the job is finalizing."""
    JobStore(r, KEYS).create(job, model="m", output=output)
    pub = Publisher(r, KEYS)
    for i in range(n):
        pub.publish(ResultRow(job_id=job, request_id=f"{job}:{i}", status="completed", idx=i,
                              output_text=f"{text} {i}", line=i + 1))
    pub.finish_submission(job, n)


def _record_update_lost(r, job: str, output: str) -> None:
    """The record as it was before its export's ``mark_exported``: finalizing, its output as asked."""
    r.hdel(KEYS.job(job), JobField.EXPORTED_AT)
    r.hset(KEYS.job(job), mapping={JobField.STATUS: JobStatus.FINALIZING.value, JobField.OUTPUT: output})


def test_the_exporter_checks_the_record_again(redis_server, places, monkeypatch):
    root, outside = places
    monkeypatch.setenv("BATCHINFER_RESULTS_ROOT", str(root))
    r = redis_server.client()
    for job, output in (("old-file", (outside / "victim.txt").as_uri()), ("old-s3", HOSTILE_S3)):
        _finished_job(r, job, output)
        with pytest.raises(ValueError, match="not an allowed destination|query string"):
            export_job(job, prefix=PREFIX, redis_url=redis_server.url)
        record = JobStore(r, KEYS).get(job)
        assert record.status == JobStatus.FAILED and "export failed" in record.errors[-1]  # no rq retry here
        assert "a:b@" not in record.errors[-1]
    assert (outside / "victim.txt").read_text() == VICTIM_TEXT


def test_the_exporter_never_replaces_a_file_its_job_did_not_write(redis_server, places, monkeypatch):
    root, outside = places
    monkeypatch.setenv("BATCHINFER_RESULTS_ROOT", str(root))
    monkeypatch.setenv("BATCHINFER_OUTPUT_URI_PREFIXES", outside.as_uri())
    r = redis_server.client()
    (root / "taken.parquet").write_text(VICTIM_TEXT)
    for job, output in (("j-uri", (outside / "victim.txt").as_uri()), ("j-rel", "taken.parquet"),
                        ("taken", None)):  # the default <root>/<job>.parquet, taken already
        _finished_job(r, job, output)
        with pytest.raises(FileExistsError, match="not written by this job"):
            export_job(job, prefix=PREFIX, redis_url=redis_server.url)
        assert JobStore(r, KEYS).get(job).status == JobStatus.FAILED
    assert (outside / "victim.txt").read_text() == (root / "taken.parquet").read_text() == VICTIM_TEXT
    assert sorted(p.name for p in [*root.iterdir(), *outside.iterdir()]) == ["taken.parquet", "victim.txt"]


def test_a_job_re_exports_its_own_file(redis_server, places, monkeypatch):
    root, _ = places
    monkeypatch.setenv("BATCHINFER_RESULTS_ROOT", str(root))
    r = redis_server.client()
    _finished_job(r, "mine", "team/mine.parquet", n=3)
    location = export_job("mine", prefix=PREFIX, redis_url=redis_server.url)
    assert location == str(root / "team" / "mine.parquet") and pq.read_table(location).num_rows == 3
    first = Path(location).stat().st_ino
    again = export_job("mine", prefix=PREFIX, redis_url=redis_server.url)  # the record names its file
    assert again == location and Path(location).stat().st_ino != first  # written anew, in place
    assert JobStore(r, KEYS).get("mine").status == JobStatus.COMPLETED
    # An export whose rename happened but whose record was not updated (Redis went away) is retried:
    # the file there holds exactly the bytes it writes, so it is kept and the job completes.
    _finished_job(r, "cut", "cut.parquet", n=3)
    export_job("cut", prefix=PREFIX, redis_url=redis_server.url)
    kept = (root / "cut.parquet").read_bytes()
    _record_update_lost(r, "cut", "cut.parquet")
    assert export_job("cut", prefix=PREFIX, redis_url=redis_server.url) == str(root / "cut.parquet")
    assert (root / "cut.parquet").read_bytes() == kept
    assert JobStore(r, KEYS).get("cut").status == JobStatus.COMPLETED
    # ... but a file with other bytes there is someone else's
    (root / "cut.parquet").write_bytes(kept[:-1] + b"!")
    _record_update_lost(r, "cut", "cut.parquet")
    with pytest.raises(FileExistsError):
        export_job("cut", prefix=PREFIX, redis_url=redis_server.url)
    assert (root / "cut.parquet").read_bytes() == kept[:-1] + b"!"
    assert sorted(p.name for p in root.iterdir()) == ["cut.parquet", "team"]  # no temporary left


@pytest.mark.slow
def test_run_writes_its_own_output_and_force_still_replaces_one(tiny_llama, tmp_path):
    """``run``'s daemons are the caller's own: its -o joins their allow-list, and --force still
    replaces an existing file (removed as the run starts: its exporter replaces no foreign file)."""
    out = tmp_path / "out.jsonl"
    out.write_text(VICTIM_TEXT)
    f = tmp_path / "in.jsonl"
    f.write_text('{"prompt": "a", "max_tokens": 2}\n{"prompt": "b", "max_tokens": 2}\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHINFER_")}
    proc = subprocess.run([*CLI, "run", str(f), "-o", str(out), "--force", "--echo",
                           "--model", str(tiny_llama), "--logs", str(tmp_path / "logs"), "--json"],
                          env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S, cwd=tmp_path)
    logs = "\n".join(p.read_text() for p in (tmp_path / "logs").glob("*.log"))
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n{logs}"
    assert [json.loads(line)["line"] for line in out.read_text().splitlines()] == [1, 2]
