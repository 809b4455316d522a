"""A tensor-parallel worker daemon (issue 17) as real processes: ``batchinfer worker
--tensor-parallel-size 2 --device cpu`` serves a job; a SIGKILLed rank process takes the worker
down with a non-zero exit while the job completes exactly once on another worker; a SIGKILLed
TP worker leaves no rank behind (each rank watches its parent). "Nothing left behind" is checked
on the worker's process group (each daemon is a session leader), before the stack's own cleanup
kills that group anyway.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner
from daemons import CLI, FAULT_ENV, Stack, assert_exactly_once, wait_for

from batchinfer.cli.context import EXIT_STARTUP
from batchinfer.cli.main import cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "tiny-llama"  # the tiny_llama fixture's folder name
EXIT_ENGINE_BROKEN = 3


def _proc_stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat fields after the command name (state, ppid, pgrp, ...); None when gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _live_in_group(pgid: int) -> list[int]:
    """Processes of process group ``pgid`` that are not zombies."""
    found = []
    for entry in os.listdir("/proc"):
        fields = _proc_stat(int(entry)) if entry.isdigit() else None
        if fields is not None and int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(entry))
    return found


def _rank_processes(worker_pid: int) -> list[int]:
    """The worker's spawned rank processes (not multiprocessing's resource tracker)."""
    ranks = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or (fields := _proc_stat(int(entry))) is None or int(fields[1]) != worker_pid:
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmdline:
            ranks.append(int(entry))
    return ranks


def _tp_worker(stack: Stack, name: str, model: Path) -> None:
    stack.start(name, "worker", "--name", name, "--model", str(model), "--device", "cpu",
                "--tensor-parallel-size", "2", "--engine-option", "max_num_seqs=2")


def _requests(n: int, max_tokens: int) -> list[dict]:
    return [{"custom_id": f"r{i}", "prompt": f"The request number {i}", "max_tokens": max_tokens,
             "ignore_eos": True, "temperature": 0} for i in range(n)]


def test_tp_worker_serves_jobs_and_a_killed_rank_or_worker_leaves_nothing_behind(redis_server, tiny_llama,
                                                                                  tmp_path):
    stack = Stack(redis_server.url, tmp_path, env=FAULT_ENV)
    try:
        stack.start("scheduler", "scheduler")
        stack.start("exporter", "exporter")
        _tp_worker(stack, "tp", tiny_llama)
        stack.wait_for_worker("tp")
        client = stack.client
        tp_pid = stack.procs["tp"].pid
        (rank_pid,) = _rank_processes(tp_pid)

        # 1. A real job through the TP=2 worker.
        job = client.submit(_requests(4, 6), model=MODEL)
        record = stack.wait(job, timeout=120)
        assert record.status.value == "completed", (record, stack.logs())
        rows = assert_exactly_once(stack, job, 4, record)
        assert all(r["status"] == "completed" and r["completion_tokens"] == 6 and r["worker"] == "tp"
                   for r in rows), rows

        # 2. SIGKILL of the rank process mid-job: the worker exits non-zero, nothing of it is left.
        n = 40
        job = client.submit(_requests(n, 16), model=MODEL)
        stack.until(lambda: any(r["worker"] == "tp" for r in client.result_rows(job)), 120, "tp mid-job")
        os.kill(rank_pid, signal.SIGKILL)
        worker = stack.procs["tp"]
        code = worker.wait(timeout=60)
        assert code == EXIT_ENGINE_BROKEN, stack.logs()
        wait_for(lambda: not _live_in_group(tp_pid), "the TP worker's processes to be gone", 30,
                 details=lambda: f"left: {_live_in_group(tp_pid)}\n{stack.logs()}")
        log = (tmp_path / "tp.log").read_text()
        assert f"rank 1 (pid {rank_pid}) was killed by SIGKILL" in log
        stack.wait_exit("tp")
        done_by_tp = sum(r["worker"] == "tp" for r in client.result_rows(job))
        assert 0 < done_by_tp < n, "the kill was meant to land mid-job"

        # 3. Another TP worker finishes the job (the dead worker's batches return by lease): exactly once.
        _tp_worker(stack, "tp2", tiny_llama)
        record = stack.wait(job, timeout=180)
        assert record.status.value == "completed", (record, stack.logs())
        rows = assert_exactly_once(stack, job, n, record)
        assert all(r["status"] == "completed" and r["completion_tokens"] == 16 for r in rows)
        assert {r["worker"] for r in rows} == {"tp", "tp2"}

        # 4. SIGKILL of the TP worker alone (not its group): its rank sees its parent gone and exits.
        tp2_pid = stack.procs["tp2"].pid
        (rank2_pid,) = _rank_processes(tp2_pid)
        os.kill(tp2_pid, signal.SIGKILL)
        wait_for(lambda: _proc_stat(rank2_pid) is None or _proc_stat(rank2_pid)[0] == "Z",
                 "the orphaned rank to exit", 30)
        wait_for(lambda: not _live_in_group(tp2_pid), "the killed TP worker's processes to be gone", 30,
                 details=lambda: f"left: {_live_in_group(tp2_pid)}")
        assert stack.wait_exit("tp2") == -signal.SIGKILL
    finally:
        stack.close()


def test_tp_flags_that_cannot_work_are_refused_in_one_line(tiny_llama, tmp_path):
    """--tensor-parallel-size with --echo is a usage error; a device list that is not one GPU per
    rank, and a model whose heads the size does not divide, are one-line start-up errors (exit 9)."""
    usage = CliRunner().invoke(cli, ["worker", "--echo", "--tensor-parallel-size", "2"])
    assert usage.exit_code == 2 and "--tensor-parallel-size" in usage.output, usage.output

    def worker(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*CLI, "--redis-url", "redis://127.0.0.1:1/0", "worker", *args],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path)

    proc = worker("--model", str(tiny_llama), "--tensor-parallel-size", "2", "--device", "cpu,cpu")
    assert proc.returncode == EXIT_STARTUP, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "device 'cpu,cpu'" in line and "CUDA devices only" in line
    from batchinfer.workers.models.tiny import make_tiny_model

    three = make_tiny_model(tmp_path / "three-heads", num_attention_heads=3, num_key_value_heads=3,
                            hidden_size=48)
    proc = worker("--model", str(three), "--tensor-parallel-size", "2", "--device", "cpu")
    assert proc.returncode == EXIT_STARTUP, proc.stderr
    assert "Traceback" not in proc.stderr and "head" in proc.stderr.lower(), proc.stderr


def test_batchinfer_run_passes_tensor_parallelism_and_the_grammar_backend_on(tiny_llama, tmp_path):
    """``run --tensor-parallel-size 2 --structured-outputs-backend xgrammar``: the worker it starts
    constrains the JSON line with xgrammar over two ranks; greedy tokens equal TP=1 in-process."""
    import json

    from structured_cases import check_output

    from batchinfer import LLM, SamplingParams
    from batchinfer.workers.structured_params import StructuredOutputsParams

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    lines = [{"custom_id": "free", "prompt": "Hello there", "max_tokens": 8, "temperature": 0},
             {"custom_id": "json", "prompt": "Count:", "max_tokens": 16, "temperature": 0,
              "structured_outputs": {"json": schema}}]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out, logs = tmp_path / "out.jsonl", tmp_path / "logs"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("BATCHINFER_REDIS_URL", None)
    proc = subprocess.run([*CLI, "run", str(src), "-o", str(out), "--model", str(tiny_llama),
                           "--device", "cpu", "--tensor-parallel-size", "2",
                           "--structured-outputs-backend", "xgrammar",
                           "--logs", str(logs), "--json"],
                          env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    worker_log = "\n".join(p.read_text() for p in logs.glob("worker-*.log"))
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n{worker_log}"
    assert "tensor parallelism: 2 ranks ready" in worker_log
    rows = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert all(r["status"] == "completed" for r in rows.values()), rows
    params = StructuredOutputsParams(json=schema)
    check_output(params, rows["json"]["output_text"])
    assert rows["json"]["structured"] == "json" and rows["json"]["structured_complete"] is True
    llm = LLM(model=str(tiny_llama), structured_outputs_backend="xgrammar")
    ref = llm.generate(["Hello there", "Count:"], [SamplingParams(max_tokens=8, temperature=0),
                       SamplingParams(max_tokens=16, temperature=0, structured_outputs=params)])
    assert rows["free"]["output_token_ids"] == ref[0].outputs[0].token_ids
    assert rows["json"]["output_token_ids"] == ref[1].outputs[0].token_ids
