"""`batchinfer run` stopped by Ctrl-C or --timeout: it says so at once, cancels its job, is done in
seconds, keeps its logs and writes a row for every line, the unfinished ones `cancelled` (unless
--no-partial). Real subprocesses, real SIGINT."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from daemons import CLI, START_TIMEOUT_S, wait_until

from batchinfer.config import Settings
from batchinfer.keys import Keys
from batchinfer.redis_conn import connect

STOP_WITHIN_S = 15.0  # SIGTERM, 2 s grace, SIGTERM, 1 s, SIGKILL; then the partial file


# More lines than the worker can finish after the Ctrl-C (it drains what runs: at most max_num_seqs,
# 256), so the partial file cannot hold them all even when the first rows came late (400 did, once).
LINES = 2000


def long_input(tmp_path: Path, n: int = LINES) -> Path:
    f = tmp_path / "long.jsonl"
    f.write_text("".join(json.dumps({"custom_id": f"c{i}", "prompt": f"line {i}", "max_tokens": 200,
                                     "ignore_eos": True}) + "\n" for i in range(n)))
    return f


class Run:
    """``batchinfer run`` in a subprocess; ``seen``: its stderr lines so far, read by a thread."""

    def __init__(self, tmp_path: Path, *args: str):
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.env.pop("BATCHINFER_REDIS_URL", None)
        self.proc = subprocess.Popen([*CLI, "run", *args], env=self.env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, cwd=tmp_path)
        self.seen: list[str] = []
        stderr = self.proc.stderr
        assert stderr is not None
        self.reader = threading.Thread(target=lambda: self.seen.extend(iter(stderr.readline, "")),
                                       daemon=True)
        self.reader.start()

    def wait(self, timeout: float) -> tuple[int, str]:
        """The exit code, and all of stderr (read to its end: nothing still in flight)."""
        code = self.proc.wait(timeout=timeout)
        self.reader.join(timeout=30)
        assert not self.reader.is_alive(), "stderr still open after the exit"
        return code, "".join(self.seen)


def reported_rows(text: str) -> int:
    """N of the "wrote the results so far (N of LINES rows)" line."""
    match = re.search(rf"wrote the results so far \((\d+) of {LINES} rows\)", text)
    assert match, text
    return int(match.group(1))


def wait_for(seen: list[str], proc: subprocess.Popen, prefix: str, timeout: float = START_TIMEOUT_S) -> str:
    deadline = time.monotonic() + timeout
    while True:
        line = next((s for s in seen if s.startswith(prefix)), None)
        if line is not None:
            return line
        assert proc.poll() is None or time.monotonic() < deadline, "".join(seen)
        assert time.monotonic() < deadline, "".join(seen)
        time.sleep(0.05)


def test_ctrl_c_stops_quickly_and_writes_the_partial_results(tiny_llama, tmp_path):
    out = tmp_path / "out.parquet"
    run = Run(tmp_path, str(long_input(tmp_path)), "-o", str(out), "--model", str(tiny_llama))
    proc, seen = run.proc, run.seen
    url = wait_for(seen, proc, "redis: embedded redis-server on ").split(" on ", 1)[1].strip()
    job = wait_for(seen, proc, "job ").split()[1]
    results = Keys(Settings.from_env(run.env).prefix).results(job)
    with connect(url) as r:  # the run's own Redis: wait for some rows in
        wait_until(lambda: r.xlen(results) > 0, timeout=START_TIMEOUT_S, what="the job's first rows")
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    wait_for(seen, proc, "stopping...", timeout=2)
    assert time.monotonic() - sent < 2, "stopping... is said at once"
    code, text = run.wait(timeout=STOP_WITHIN_S)
    assert code == 130, text
    assert time.monotonic() - sent < STOP_WITHIN_S
    rows = pq.read_table(out).to_pylist()
    assert len(rows) == reported_rows(text) == LINES, text  # a row for every line, as `cancel` gives
    assert sorted(r["idx"] for r in rows) == list(range(LINES))
    statuses = {r["status"] for r in rows}
    assert "completed" in statuses and "cancelled" in statuses, statuses  # rows were in before the Ctrl-C
    assert f"cancelled job {job}" in text, text
    logs = Path(wait_for(seen, proc, "logs kept in ").split("logs kept in ", 1)[1].strip())
    assert logs.is_dir() and (logs / "worker-0.log").is_file()


def test_timeout_writes_partial_results_and_no_partial_does_not(tiny_llama, tmp_path):
    out = tmp_path / "out.jsonl"
    run = Run(tmp_path, str(long_input(tmp_path)), "-o", str(out), "--model", str(tiny_llama),
              "--timeout", "5")
    code, text = run.wait(timeout=START_TIMEOUT_S + STOP_WITHIN_S)
    assert code == 6, text
    assert "after 5 s; stopping..." in text, text
    # however many rows 5 s gave (none, on a slow box), the job was cancelled: a row for every line
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == reported_rows(text) == LINES, text
    assert sorted(x["idx"] for x in lines) == list(range(LINES))
    assert {x["status"] for x in lines} <= {"completed", "cancelled"} and "cancelled job " in text
    other = tmp_path / "none.parquet"
    run = Run(tmp_path, str(long_input(tmp_path)), "-o", str(other), "--model", str(tiny_llama),
              "--timeout", "3", "--no-partial")
    code, text = run.wait(timeout=START_TIMEOUT_S + STOP_WITHIN_S)
    assert code == 6, text
    assert "wrote the results so far" not in text and not other.exists()


@pytest.mark.parametrize("flag", ["--served-model-name"])
def test_run_answers_lines_naming_another_model(tiny_llama, tmp_path, flag):
    f = tmp_path / "openai.jsonl"
    f.write_text("".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                                     "body": {"model": "gpt-4o-mini", "max_tokens": 4,
                                              "messages": [{"role": "user", "content": f"hi {i}"}]}}) + "\n"
                         for i in range(3)))
    out = tmp_path / "out.parquet"
    run = Run(tmp_path, str(f), "-o", str(out), "--model", str(tiny_llama), flag, "local", "--timeout", "120")
    code, text = run.wait(timeout=START_TIMEOUT_S + 120)
    assert code == 0, text
    rows = pq.read_table(out).to_pylist()
    assert [r["status"] for r in rows] == ["completed"] * 3, rows
    assert "note: 3 lines named another model ('gpt-4o-mini'); the job's model 'local' answered them" in text
