"""docs/protocol.md's redis-cli example runs as written: a direct request and a whole job, with
the ``redis-cli`` binary, against a scheduler and a worker serving the model the doc names."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from daemons import Stack

from batchinfer.keys import Keys
from batchinfer.store.registry import Registry
from batchinfer.workers.models.tiny import make_tiny_demo_model

DOC = Path(__file__).resolve().parents[1] / "docs" / "protocol.md"
MARKER = "<!-- tests/test_protocol_doc.py runs the commands of the next block with redis-cli -->"
PARTITIONED = "<!-- tests/test_protocol_doc.py runs the commands of the next block with redis-cli, P = 4 -->"


def doc_block(marker: str = MARKER) -> str:
    text = DOC.read_text(encoding="utf-8")
    assert marker in text, "the tested redis-cli block lost its marker"
    m = re.search(r"```sh\n(.*?)```", text[text.index(marker):], re.S)
    assert m
    return m.group(1)


def test_the_block_names_the_demo_model_and_unique_ids():
    block = doc_block()
    assert "MODEL=demo" in block  # the model `batchinfer run --model demo` serves
    assert 'ID="my-service-$(date +%s)-$RANDOM"' in block  # a second run is a new request


def _serve_demo(redis_server, tmp_path, partitions: int = 1) -> Stack:
    """A scheduler and a worker serving the tiny model as "demo" under the prefix ``{bi}``."""
    # the tiny model in a folder named "demo": served as "demo", the name `batchinfer run --model demo` uses
    demo = make_tiny_demo_model(tmp_path / "demo")
    stack = Stack(redis_server.url, tmp_path, env={"BATCHINFER_PREFIX": "{bi}",
                                                   "BATCHINFER_PARTITIONS": str(partitions)})
    try:
        stack.start("scheduler", "scheduler")
        stack.worker("w1", demo)
        registry = Registry(redis_server.client(), Keys("{bi}"))
        deadline = time.monotonic() + 120
        while not registry.live_workers("demo"):
            stack.check_alive()
            assert time.monotonic() < deadline, stack.logs()
            time.sleep(0.2)
    except BaseException:
        stack.close()
        raise
    return stack


@pytest.mark.skipif(shutil.which("redis-cli") is None, reason="redis-cli is not on PATH")
def test_the_redis_cli_example_runs_verbatim(redis_server, tmp_path):
    stack = _serve_demo(redis_server, tmp_path)
    try:
        # the doc's commands, verbatim; only `redis-cli` is pointed at this test's server
        script = f'set -eu\nredis-cli() {{ command redis-cli -p {redis_server.port} "$@"; }}\n{doc_block()}'
        out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=180)
        assert out.returncode == 0, (out.stdout, out.stderr, stack.logs())
        text = out.stdout
        # the direct request's row came back on its reply stream
        assert '"custom_id":"q1"' in text and text.count('"status":"completed"') >= 3, text
        # the job's two rows, and its record: both completed, nothing failed
        assert '"custom_id":"a"' in text and '"custom_id":"b"' in text
        status, total, completed, failed = text.strip().splitlines()[-4:]
        assert status in ("finalizing", "completed") and (total, completed, failed) == ("2", "2", "0"), text
    finally:
        stack.close()


@pytest.mark.skipif(any(shutil.which(tool) is None for tool in ("redis-cli", "gzip", "od")),
                    reason="redis-cli, gzip or od is not on PATH")
def test_the_partitioned_job_example_runs_verbatim(redis_server, tmp_path):
    block = doc_block(PARTITIONED)
    assert "P=4" in block
    stack = _serve_demo(redis_server, tmp_path, partitions=4)
    try:
        script = (f'set -eu\nredis-cli() {{ command redis-cli -p {redis_server.port} "$@"; }}\n{block}'
                  'echo "$JOB $N"\n')
        out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=180)
        assert out.returncode == 0, (out.stdout, out.stderr, stack.logs())
        lines = out.stdout.strip().splitlines()
        status, total, completed, failed, routed = lines[-5:]
        assert '"custom_id":"a"' in out.stdout and '"status":"completed"' in out.stdout, out.stdout
        assert status in ("finalizing", "completed") and (total, completed, failed) == ("1", "1", "0"), lines
        job, partition = routed.split()
        assert Keys("{bi}", 4).job_partition(job) == int(partition)  # the doc's rule is ours
    finally:
        stack.close()
