"""Fault 7: the export fails — the disk is full, or the output path cannot be written.

"Disk full" is the exporter running under ``RLIMIT_FSIZE`` (64 KiB): writing the Parquet file
fails with EFBIG, as a full disk fails with ENOSPC, half-way through the file. "Unwritable" is an
output folder that is a file. Either way the job must stay ``finalizing`` (not completed), the
error must show in ``batchinfer status``, no partial file may be left, and the rq job must be
retried; once the cause is gone, the retry (10 s later) completes the job.
"""

from __future__ import annotations

import random
import resource
import string

import pytest
from daemons import assert_exactly_once
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from batchinfer.jobs.export import rq_job_id

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

N = 100
FILE_LIMIT = 64 * 1024


def _small_disk() -> None:  # runs in the exporter's process before exec
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_LIMIT, FILE_LIMIT))


@pytest.mark.parametrize("cause", ["disk_full", "unwritable"])
def test_export_failure_leaves_the_job_unfinished_retries_and_shows_the_error(redis_server, stacks, cause):
    stack = stacks(redis_server.url)
    results = stack.tmp / "results"
    results.mkdir()
    stack.start("scheduler", "scheduler")
    stack.start("exporter-0", "exporter", preexec_fn=_small_disk if cause == "disk_full" else None)
    stack.worker("w", echo=True)
    stack.wait_for_workers(1)
    if cause == "unwritable":
        (results / "blocked").write_text("a file where the output folder should be")
        output, expected = "blocked/out.parquet", "blocked"
    else:
        output, expected = "out.parquet", "File too large"
    rng = random.Random(7)  # incompressible prompts: the file is far over the limit
    prompts = ["".join(rng.choices(string.ascii_letters, k=1500)) for _ in range(N)]
    client = stack.client
    job = client.submit([{"prompt": p, "max_tokens": 1500} for p in prompts], model="echo", output=output)

    record = stack.until(lambda: (rec := client.status(job)).errors and rec, 60, "the export to fail")
    assert record.status.value == "finalizing" and record.done == N, record
    assert any("export failed" in e and expected in e for e in record.errors), record.errors
    shown = stack.cli("status", job)
    assert shown.returncode == 0, shown.stderr
    assert "finalizing" in shown.stdout and "export failed" in shown.stdout and expected in shown.stdout
    rq_job = Job.fetch(rq_job_id("export", stack.prefix, job), connection=client.redis,
                       serializer=JSONSerializer)
    stack.until(lambda: rq_job.get_status(refresh=True) == JobStatus.SCHEDULED, 10, "the rq retry")
    assert rq_job.retries_left == 2
    leftovers = [p.name for p in results.rglob("*") if p.name != "blocked"]
    assert leftovers == [], f"a failed export left files behind: {leftovers}"

    if cause == "disk_full":  # room again: an exporter without the limit takes over
        assert stack.stop("exporter-0") == 0
        stack.start("exporter-1", "exporter")
    else:
        (results / "blocked").unlink()
    record = stack.wait(job, timeout=60)
    assert record.status.value == "completed", (record, stack.logs())
    assert record.output == str(results / output)
    rows = assert_exactly_once(stack, job, N, record)
    assert all(r["output_text"] == prompts[r["idx"]] for r in rows)
    shown = stack.cli("status", job)
    assert shown.returncode == 0 and "completed" in shown.stdout and str(results / output) in shown.stdout
    assert len(record.errors) == 1  # the failed try stays on the record, for the operator
