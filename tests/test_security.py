"""Security (issue 5): no secret in ``Settings``, no pickle on the data path, limits with defaults and
flags, outputs confined to the results root, no remote code, read-only model folders.
(Redis ACL users and TLS: tests/test_security_tls.py.)
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import zlib
from pathlib import Path

import pytest
from click.testing import CliRunner
from daemons import wait_for

from batchinfer.cli.context import EXIT_USAGE
from batchinfer.cli.main import cli
from batchinfer.cli.runner import python_module
from batchinfer.client.client import Client
from batchinfer.config import Settings
from batchinfer.jobs.export import enqueue_export, export_job
from batchinfer.keys import RQ_QUEUE, Keys
from batchinfer.protocol.rows import ResultRow
from batchinfer.scheduler.daemon import SchedulerDaemon
from batchinfer.store.jobstore import JobStatus, JobStore
from batchinfer.store.publish import Publisher
from batchinfer.store.registry import Registry

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = ("batchinfer", "workers", "jobs", "kernels")
PREFIX = "{sec}"
PASSWORD = "Dmn-pw-7f1c9e2a"


# -- secrets ----------------------------------------------------------------------------------------------


def test_settings_never_show_the_password():
    s = Settings(redis_url=f"rediss://batchinfer:{PASSWORD}@redis.internal:6380/0")
    assert PASSWORD not in repr(s) and PASSWORD not in str(s) and PASSWORD not in (s.redacted_url() or "")
    assert "rediss://batchinfer:***@redis.internal:6380/0" in repr(s)


# -- no pickle on the data path -------------------------------------------------------------------------


class Mkdir:
    """A pickle that creates a folder when loaded: its absence proves nobody loaded it."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return os.mkdir, (self.path,)


def test_rq_jobs_are_json_and_a_pickled_rq_job_is_refused(redis_server, tmp_path):
    from rq import Queue

    from batchinfer.jobs.exporter import build_worker

    r = redis_server.client()
    settings = Settings(redis_url=redis_server.url, prefix=PREFIX)
    JobStore(r, Keys(PREFIX)).create("j-json", model="m")
    rq_id = enqueue_export(r, settings, "j-json")
    data = zlib.decompress(r.hget(f"rq:job:{rq_id}", "data"))
    assert not data.startswith(b"\x80")  # pickle's protocol 2+ opcode
    func, instance, args, kwargs = json.loads(data)
    assert (func, instance, args, kwargs["prefix"]) == ("batchinfer.jobs.export.export_job", None, ["j-json"],
                                                          PREFIX)
    r.delete(f"rq:job:{rq_id}")
    r.delete(f"rq:queue:{RQ_QUEUE}")
    # someone enqueues a pickled job (rq's default serializer) on batchinfer's queue
    marker = tmp_path / "loaded"
    evil = Queue(RQ_QUEUE, connection=r).enqueue(os.mkdir, str(marker))
    assert r.hget(f"rq:job:{evil.id}", "data").startswith(b"x")  # zlib: a pickle inside
    assert build_worker(r).work(burst=True)  # the exporter does not die on it...
    assert not marker.exists()  # ...and did not load it
    assert r.hget(f"rq:job:{evil.id}", "status") == b"failed"


def test_no_pickle_or_remote_code_anywhere_in_the_package():
    """Static guard: nothing in the package can unpickle, run a checkpoint's code, or build an rq queue or
    worker without the JSON serializer."""
    forbidden = re.compile(r"\bimport (c?pickle|dill|cloudpickle|marshal|shelve|joblib)\b|pickle\.loads?\("
                           r"|read_pickle|allow_pickle\s*=\s*True|trust_remote_code|(?<![.\w])(exec|eval)\(")
    torch_load = re.compile(r"torch\.load\((?![^)]*weights_only\s*=\s*True)")
    # rq's Queue / Worker, not the standard library's queue.Queue (the worker's publisher hand-over)
    rq_objects = re.compile(r"(?<!queue\.)\b(Queue|Worker|SimpleWorker)\("
                            r"(?![^)]*serializer=JSONSerializer)[^)]*\)")
    found = []
    for folder in PACKAGE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            text = path.read_text()
            for pattern in (forbidden, torch_load, rq_objects):
                found += [f"{path.relative_to(ROOT)}: {m.group(0)}" for m in pattern.finditer(text)]
    assert found == []


# -- limits ---------------------------------------------------------------------------------------------


def test_limits_have_defaults_environment_variables_and_flags(redis_server, tmp_path):
    defaults = Settings()
    assert (defaults.max_line_bytes, defaults.max_requests_per_job, defaults.max_tokens_limit,
            defaults.max_prompt_tokens) == (10 * 1024 * 1024, 50_000_000, 1_000_000, 1_000_000)
    env = {"BATCHINFER_MAX_LINE_BYTES": "100", "BATCHINFER_MAX_REQUESTS_PER_JOB": "5",
           "BATCHINFER_MAX_TOKENS_LIMIT": "64", "BATCHINFER_MAX_PROMPT_TOKENS": "32"}
    s = Settings.from_env(env)
    limits = (s.max_line_bytes, s.max_requests_per_job, s.max_tokens_limit, s.max_prompt_tokens)
    assert limits == (100, 5, 64, 32)
    # the submitter's flags: an over-long line is answered at once, too many requests are refused
    f = tmp_path / "in.jsonl"
    f.write_text('{"prompt": "a"}\n{"prompt": "' + "b" * 80 + '"}\n{"prompt": "c"}\n')
    args = ["--redis-url", redis_server.url, "--prefix", PREFIX, "submit", str(f), "--model", "m"]
    ok = CliRunner().invoke(cli, [*args, "--max-line-bytes", "60", "--json"], catch_exceptions=False)
    assert ok.exit_code == 0, ok.output
    client = Client(settings=Settings(redis_url=redis_server.url, prefix=PREFIX))
    [row] = client.result_rows(json.loads(ok.stdout)["job_id"])
    assert (row["line"], row["error_code"]) == (2, "line_too_long") and "limit of 60" in row["error_message"]
    refused = CliRunner().invoke(cli, [*args, "--max-requests", "2"], catch_exceptions=False)
    assert refused.exit_code == EXIT_USAGE and "more than 2 requests" in refused.output
    [cancelled] = [j for j in client.jobs() if j.id != json.loads(ok.stdout)["job_id"]]
    assert cancelled.status == JobStatus.CANCELLING and "more than 2 requests" in cancelled.errors[0]


# -- outputs stay in the results root -------------------------------------------------------------------


def _finalize(r, job: str) -> None:
    """Publish the one request's row, as a worker would: the job becomes finalizing."""
    Publisher(r, Keys(PREFIX)).publish(ResultRow(job_id=job, request_id=f"{job}:0", status="completed", idx=0,
                                                 output_text="ok", line=1))


def test_outputs_stay_in_the_results_root_or_an_allowed_uri(redis_server, tmp_path, monkeypatch):
    root, outside = tmp_path / "results", tmp_path / "elsewhere"
    root.mkdir()
    outside.mkdir()
    monkeypatch.setenv("BATCHINFER_RESULTS_ROOT", str(root))  # what the exporter reads
    settings = Settings(redis_url=redis_server.url, prefix=PREFIX, results_root=str(root))
    client, r = Client(settings=settings), redis_server.client()
    f = tmp_path / "in.jsonl"
    f.write_text('{"prompt": "a"}\n')
    for bad in ("../escape.parquet", "a/../../escape.parquet", str(outside / "x.parquet")):
        with pytest.raises(ValueError, match="outside the results folder"):
            client.submit(f, model="m", output=bad)
    cli_args = ["--redis-url", redis_server.url, "--prefix", PREFIX, "submit", str(f), "--output", "/etc/x"]
    runner = CliRunner(env={"BATCHINFER_RESULTS_ROOT": str(root)})
    result = runner.invoke(cli, cli_args, catch_exceptions=False)
    assert result.exit_code == EXIT_USAGE and "outside the results folder" in result.output
    assert client.jobs() == []  # refused before anything was queued
    # records written by another producer are confined by the exporter itself (symlinks resolved)
    (root / "link").symlink_to(outside)
    for job, output in (("abs", str(outside / "a.parquet")), ("link", "link/b.parquet")):
        JobStore(r, Keys(PREFIX)).create(job, model="m", output=output)
        Publisher(r, Keys(PREFIX)).finish_submission(job, 1)
        _finalize(r, job)
        with pytest.raises(ValueError, match="outside the results folder"):
            export_job(job, prefix=PREFIX, redis_url=redis_server.url)
        record = client.status(job)
        assert record.status != JobStatus.COMPLETED and "outside the results folder" in record.errors[-1]
    assert list(outside.iterdir()) == []
    # a path inside the root, and a URI under an allowed prefix (none by default), are written
    inside = client.submit(f, model="m", output="team/out.parquet")
    uri = (outside / "u.parquet").as_uri()
    with pytest.raises(ValueError, match="not an allowed destination"):
        client.submit(f, model="m", output=uri)
    monkeypatch.setenv("BATCHINFER_OUTPUT_URI_PREFIXES", outside.as_uri())
    settings.output_uri_prefixes = outside.as_uri()
    anywhere = client.submit(f, model="m", output=uri)
    for job in (inside, anywhere):
        _finalize(r, job)
        export_job(job, prefix=PREFIX, redis_url=redis_server.url)
        assert client.status(job).status == JobStatus.COMPLETED
    assert (root / "team" / "out.parquet").is_file() and (outside / "u.parquet").is_file()
    assert client.status(anywhere).output == uri


# -- model folders: read-only, and none of their code runs ----------------------------------------------


def _rows(r, keys: Keys, job: str) -> dict[int, ResultRow]:
    return {row.idx: row for row in (ResultRow.from_json(f[b"row"]) for _, f in r.xrange(keys.results(job)))}


def _snapshot(folder: Path) -> dict[str, tuple]:
    return {str(p.relative_to(folder)): (p.stat().st_mode, p.stat().st_size, p.stat().st_mtime_ns,
                                         hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None)
            for p in sorted(folder.rglob("*"))}


def _read_only_mount(folder: Path) -> tuple[str, ...]:
    """As root, chmod binds nobody: then the worker sees ``folder`` through a read-only bind mount in
    a private mount namespace, when this machine allows one (else the snapshot check alone holds)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return ()
    if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        return ()
    script = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" "$0" && exec "$@"'
    wrapper = ("unshare", "-m", "sh", "-c", script, str(folder))
    probe = folder / ".write-probe"
    if subprocess.run([*wrapper, "touch", str(probe)], capture_output=True).returncode == 0 or probe.exists():
        pytest.fail(f"the read-only bind mount of {folder} let a write through")
    return wrapper


@pytest.mark.slow
def test_worker_serves_a_read_only_model_folder_and_runs_none_of_its_code(redis_server, tiny_llama, tmp_path):
    from batchinfer.protocol.rows import BatchRequest

    model = tmp_path / "tiny-ro"
    shutil.copytree(tiny_llama, model)
    marker = tmp_path / "checkpoint-code-ran"
    for name in ("modeling_evil.py", "configuration_evil.py", "tokenization_evil.py", "__init__.py"):
        (model / name).write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n")
    auto_maps = {"config.json": {"AutoConfig": "configuration_evil.EvilConfig",
                                 "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"},
                 "tokenizer_config.json": {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}}
    for name, auto_map in auto_maps.items():
        config = json.loads((model / name).read_text())
        (model / name).write_text(json.dumps({**config, "auto_map": auto_map}))
    for path in [*model.rglob("*"), model]:
        path.chmod(0o555 if path.is_dir() else 0o444)
    before = _snapshot(model)
    env = {**os.environ, "BATCHINFER_REDIS_URL": redis_server.url, "BATCHINFER_PREFIX": "{ro}",
           "BATCHINFER_HEARTBEAT_SECONDS": "0.5", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    log_file = tmp_path / "worker.log"
    with open(log_file, "wb") as log:
        worker = subprocess.Popen([*_read_only_mount(model), *python_module("batchinfer.cli"), "worker",
                                   "--model", str(model), "--device", "cpu", "--name", "ro-w"],
                                  env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def alive() -> None:
        assert worker.poll() is None, f"the worker exited with {worker.returncode}:\n{log_file.read_text()}"

    try:
        r, keys = redis_server.client(), Keys("{ro}")
        wait_for(lambda: Registry(r, keys).live_workers("tiny-ro"), "the worker", 300, alive)
        settings = Settings(redis_url=redis_server.url, prefix="{ro}")
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        job = Client(settings=settings).submit([{"prompt": "Hello", "max_tokens": 4, "temperature": 0}, chat],
                                               model="tiny-ro")
        # a producer writing the batch stream itself, with a token id the model does not have
        JobStore(r, keys).create("oov", model="tiny-ro")
        requests = [BatchRequest(request_id=f"oov:{i}", job_id="oov", idx=i, line=i + 1, model="tiny-ro",
                                 prompt_token_ids=ids, sampling_params={"max_tokens": 2}, created_at=1)
                    for i, ids in enumerate(([5, 6, 5000], [5, 6, 7]))]
        r.xadd(keys.batches("tiny-ro"), {"v": "1", "requests": json.dumps([q.to_dict() for q in requests])})
        Publisher(r, keys).finish_submission("oov", 2)
        scheduler = SchedulerDaemon(r, settings)
        store = JobStore(r, keys)

        def done() -> bool:
            scheduler.run_once()
            return all(store.get(j).status == JobStatus.FINALIZING for j in (job, "oov"))

        wait_for(done, "both jobs", 300, alive)
        rows, oov = _rows(r, keys, job), _rows(r, keys, "oov")
        assert [rows[i].status for i in (0, 1)] == ["completed", "completed"] and rows[0].output_token_ids
        assert (oov[0].error_code, oov[1].status) == ("invalid_request", "completed")
        assert "prompt_token_ids[2]" in oov[0].error_message and "5000" in oov[0].error_message
    finally:
        worker.send_signal(signal.SIGTERM)  # drain, exit 0
        code = worker.wait(timeout=60)
    log = log_file.read_text(errors="replace")
    assert code == 0, log
    assert "Read-only file system" not in log and "Permission denied" not in log, log
    assert _snapshot(model) == before  # nothing written, added or removed
    assert not marker.exists(), "code shipped with the checkpoint ran"
