"""`batchinfer run` stopped by Ctrl-C or --timeout: it says so at once, is done in seconds, keeps
its logs and writes the results so far (unless --no-partial). Real subprocesses, real SIGINT."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from daemons import CLI, START_TIMEOUT_S

STOP_WITHIN_S = 15.0  # SIGTERM, 2 s grace, SIGTERM, 1 s, SIGKILL; then the partial file


def long_input(tmp_path: Path, n: int = 400) -> Path:
    f = tmp_path / "long.jsonl"
    f.write_text("".join(json.dumps({"custom_id": f"c{i}", "prompt": f"line {i}", "max_tokens": 200,
                                     "ignore_eos": True}) + "\n" for i in range(n)))
    return f


def start_run(tmp_path: Path, *args: str) -> tuple[subprocess.Popen, list[str]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("BATCHINFER_REDIS_URL", None)
    proc = subprocess.Popen([*CLI, "run", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=tmp_path)
    seen: list[str] = []
    threading.Thread(target=lambda: seen.extend(iter(proc.stderr.readline, "")), daemon=True).start()
    return proc, seen


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
    proc, seen = start_run(tmp_path, str(long_input(tmp_path)), "-o", str(out), "--model", str(tiny_llama))
    wait_for(seen, proc, "job ")
    time.sleep(3)  # some rows in
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    wait_for(seen, proc, "stopping...", timeout=2)
    assert time.monotonic() - sent < 2, "stopping... is said at once"
    assert proc.wait(timeout=STOP_WITHIN_S) == 130, "".join(seen)
    assert time.monotonic() - sent < STOP_WITHIN_S
    time.sleep(0.2)
    text = "".join(seen)
    assert "wrote the results so far" in text and "of 400 rows" in text, text
    rows = pq.read_table(out).to_pylist()
    assert len(rows) < 400 and all(r["custom_id"] for r in rows)
    logs = Path(wait_for(seen, proc, "logs kept in ").split("logs kept in ", 1)[1].strip())
    assert logs.is_dir() and (logs / "worker-0.log").is_file()


def test_timeout_writes_partial_results_and_no_partial_does_not(tiny_llama, tmp_path):
    out = tmp_path / "out.jsonl"
    proc, seen = start_run(tmp_path, str(long_input(tmp_path)), "-o", str(out), "--model", str(tiny_llama),
                           "--timeout", "5")
    assert proc.wait(timeout=START_TIMEOUT_S + STOP_WITHIN_S) == 6, "".join(seen)
    time.sleep(0.2)
    text = "".join(seen)
    assert "after 5 s; stopping..." in text and "wrote the results so far" in text, text
    assert all(json.loads(line)["custom_id"] for line in out.read_text().splitlines())
    other = tmp_path / "none.parquet"
    proc, seen = start_run(tmp_path, str(long_input(tmp_path)), "-o", str(other), "--model", str(tiny_llama),
                           "--timeout", "3", "--no-partial")
    assert proc.wait(timeout=START_TIMEOUT_S + STOP_WITHIN_S) == 6, "".join(seen)
    assert not other.exists()


@pytest.mark.parametrize("flag", ["--served-model-name"])
def test_run_answers_lines_naming_another_model(tiny_llama, tmp_path, flag):
    f = tmp_path / "openai.jsonl"
    f.write_text("".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                                     "body": {"model": "gpt-4o-mini", "max_tokens": 4,
                                              "messages": [{"role": "user", "content": f"hi {i}"}]}}) + "\n"
                         for i in range(3)))
    out = tmp_path / "out.parquet"
    proc, seen = start_run(tmp_path, str(f), "-o", str(out), "--model", str(tiny_llama), flag, "local",
                           "--timeout", "120")
    assert proc.wait(timeout=START_TIMEOUT_S + 120) == 0, "".join(seen)
    time.sleep(0.2)
    rows = pq.read_table(out).to_pylist()
    assert [r["status"] for r in rows] == ["completed"] * 3, rows
    assert "note: 3 lines named another model ('gpt-4o-mini'); the job's model 'local' answered them" \
        in "".join(seen)
