"""Every Lua script runs as a registered script: EVALSHA, reloaded after a flush, never a plain EVAL."""

from __future__ import annotations

import pytest

from batchinfer.jobs.export import export_job
from batchinfer.keys import Keys
from batchinfer.protocol.rows import ResultRow
from batchinfer.store import scripts
from batchinfer.store.jobstore import JobStatus, JobStore
from batchinfer.store.publish import Publisher

PREFIX = "{sc}"


def _calls(r, command: str) -> int:
    return int(r.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


def _finalizing_job(r, job_id: str, n: int = 3) -> None:
    keys = Keys(PREFIX)
    JobStore(r, keys).create(job_id, model="m")
    pub = Publisher(r, keys)
    for i in range(n):
        pub.publish(ResultRow(job_id=job_id, request_id=f"{job_id}:{i}", status="completed", idx=i,
                              custom_id=f"c{i}", model="m", output_text=f"t{i}"))
    assert pub.finish_submission(job_id, n)


def test_export_runs_its_scripts_by_evalsha_after_a_script_flush(redis_server, tmp_path):
    r = redis_server.client()
    keys = Keys(PREFIX)
    _finalizing_job(r, "j1")
    JobStore(r, keys).create("j2", model="m")  # validating: its export fails, and is recorded
    r.script_flush()
    r.config_resetstat()

    out = tmp_path / "j1.parquet"
    assert export_job("j1", prefix=PREFIX, output=str(out), redis_url=redis_server.url) == str(out)
    with pytest.raises(RuntimeError, match="not every request"):
        export_job("j2", prefix=PREFIX, output=str(tmp_path / "j2.parquet"), redis_url=redis_server.url)

    store = JobStore(r, keys)
    assert store.get("j1").status is JobStatus.COMPLETED and out.exists()
    assert any("not every request" in e for e in store.get("j2").errors)
    assert _calls(r, "eval") == 0
    assert _calls(r, "evalsha") >= 2  # mark_exported and mark_export_failed
    assert _calls(r, "script|load") == 2  # each reloaded once after the flush


def test_job_transitions_survive_a_script_flush(redis_server):
    r = redis_server.client()
    keys = Keys(PREFIX)
    store = JobStore(r, keys)
    store.create("a")
    store.create("b")
    r.script_flush()
    r.config_resetstat()
    assert store.set_status("a", JobStatus.IN_PROGRESS, expect=[JobStatus.VALIDATING])
    assert not store.set_status("a", JobStatus.EXPIRED, expect=[JobStatus.VALIDATING])
    assert store.cancel("b") is JobStatus.CANCELLING and store.is_cancelled("b")
    assert store.get("a").status is JobStatus.IN_PROGRESS
    assert _calls(r, "eval") == 0 and _calls(r, "evalsha") >= 3


def test_lua_source_prepends_the_finalize_prelude_only_where_used():
    assert "local function maybe_finalize" in scripts.lua_source("publish")
    assert "local function maybe_finalize" in scripts.lua_source("finish_submission")
    assert "maybe_finalize" not in scripts.lua_source("mark_exported")
