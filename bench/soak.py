"""Soak: one big job through two workers while a chaos loop SIGKILLs a random worker every 20 s.

Every kill is followed at once by a replacement under a new name (as an orchestrator would start
a new pod); the killed worker's batches come back through their leases. At the end the results
stream and the exported Parquet file are checked: every request must have exactly one row
(``duplicates`` and ``lost`` must be 0). Reported: completed / failed rows, duplicates, lost,
request latency p50 / p99 (``finished_at - created_at`` of the rows: queueing included, the whole
job is submitted at once), throughput, the scheduler's peak RSS (VmHWM from /proc), Redis' peak
memory, kills, attempts counted, dead letters, and the scheduler's RSS sampled over the run
(``[seconds, rows done, MiB]``). The last line printed is one JSON object.

Runs against a private redis-server (``batchinfer.cli.embedded``) unless ``--redis-url``.

    python bench/soak.py                                    # the full run: 200,000 requests, ~5 min
    python bench/soak.py --requests 20000 --kill-every 5    # a quick one
    python bench/soak.py --model DIR --requests 2000        # the tiny model instead of the echo engine
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq

from batchinfer.cli.embedded import EmbeddedRedis
from batchinfer.cli.runner import python_module
from batchinfer.client.client import Client
from batchinfer.config import Settings
from batchinfer.jobs.export import iter_stream
from batchinfer.keys import Keys

PREFIX = "{soak}"
ECHO_OPTIONS = {"requests_per_step": 32, "max_num_seqs": 256}


class Daemons:
    """``python -m batchinfer.cli`` subprocesses (each its own process group), logs in ``logdir``."""

    def __init__(self, redis_url: str, logdir: Path, lease_seconds: float, max_attempts: int):
        self.logdir = logdir
        self.env = {**os.environ, "BATCHINFER_REDIS_URL": redis_url, "BATCHINFER_PREFIX": PREFIX,
                    "BATCHINFER_RESULTS_ROOT": str(logdir / "results"), "BATCHINFER_LOG_LEVEL": "WARNING",
                    "BATCHINFER_LEASE_SECONDS": str(lease_seconds), "BATCHINFER_HEARTBEAT_SECONDS": "1",
                    "BATCHINFER_MAX_ATTEMPTS": str(max_attempts), "OMP_NUM_THREADS": "1",
                    "TOKENIZERS_PARALLELISM": "false"}
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, *args: str) -> subprocess.Popen:
        with open(self.logdir / f"{name}.log", "ab") as log:
            proc = subprocess.Popen([*python_module("batchinfer.cli"), *args], env=self.env,
                                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        self.procs[name] = proc
        return proc

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)

    def check(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}\n{self.tail(name)}")

    def tail(self, name: str, lines: int = 30) -> str:
        path = self.logdir / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 30
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        self.procs.clear()


def rss_mb(pid: int, field: str = "VmRSS") -> float:
    """A process's resident set (``VmRSS``) or its peak (``VmHWM``) from /proc, in MiB; 0 if gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def worker_args(name: str, model_dir: str | None) -> list[str]:
    args = ["worker", "--name", name, "--device", "cpu"]
    if model_dir:
        return [*args, "--model", model_dir]
    return [*args, "--echo", *[a for k, v in ECHO_OPTIONS.items() for a in ("--engine-option", f"{k}={v}")]]


def requests(n: int, max_tokens: int):
    for i in range(n):
        yield {"custom_id": f"s{i}", "prompt": f"soak request number {i}", "max_tokens": max_tokens}


def check_rows(r, keys: Keys, job: str, n: int) -> dict:
    """Duplicates, lost and latency from the results stream (every entry, duplicates included)."""
    counts: Counter[int] = Counter()
    statuses: Counter[str] = Counter()
    latencies = []
    for _, fields in iter_stream(r, keys.results(job), count=10_000):
        row = json.loads(fields[b"row"])
        counts[row["idx"]] += 1
        statuses[row["status"]] += 1
        if row.get("finished_at") and row.get("created_at"):
            latencies.append(row["finished_at"] - row["created_at"])
    latencies.sort()

    def pct(p: float) -> int | None:
        return latencies[min(len(latencies) - 1, int(p * len(latencies)))] if latencies else None

    return {"rows": sum(counts.values()), "completed_rows": statuses["completed"],
            "failed_rows": sum(statuses.values()) - statuses["completed"],
            "duplicates": sum(c - 1 for c in counts.values() if c > 1), "lost": n - len(counts),
            "p50_latency_ms": pct(0.50), "p99_latency_ms": pct(0.99)}


def soak(args: argparse.Namespace, redis_url: str, logdir: Path) -> dict:
    daemons = Daemons(redis_url, logdir, args.lease_seconds, args.max_attempts)
    client = Client(settings=Settings(redis_url=redis_url, prefix=PREFIX))
    keys, r = client.keys, client.redis
    model = Path(args.model).name if args.model else "echo"
    rng = random.Random(args.seed)
    kills, serial, workers = 0, 0, []
    try:
        scheduler = daemons.start("scheduler", "scheduler")
        daemons.start("exporter", "exporter")
        for _ in range(args.workers):
            workers.append(f"w{serial}")
            daemons.start(workers[-1], *worker_args(workers[-1], args.model))
            serial += 1
        deadline = time.monotonic() + 300
        while not r.exists(keys.model(model)):  # a worker registered the model: requests can be tokenised
            daemons.check()
            if time.monotonic() > deadline:
                raise RuntimeError("no worker registered the model in 300 s")
            time.sleep(0.2)

        began = time.monotonic()
        job = client.submit(requests(args.requests, args.max_tokens), model=model)
        submitted_s = time.monotonic() - began
        print(f"submitted {args.requests} requests in {submitted_s:.1f} s (job {job})", flush=True)
        next_kill = began + args.kill_every
        rows_at, rss_timeline, next_rss = None, [], began
        while True:
            record = client.status(job)
            now = time.monotonic()
            if now >= next_rss:  # the scheduler's memory over the run: flat, or growing with the job?
                rss_timeline.append([round(now - began), record.done, round(rss_mb(scheduler.pid), 1)])
                next_rss = now + args.rss_every
            if rows_at is None and record.done >= args.requests:
                rows_at = now
            if record.terminal:
                break
            if now - began > args.timeout:
                raise RuntimeError(f"job {job}: {record.done} rows after {args.timeout} s")
            if args.kill_every > 0 and now >= next_kill and rows_at is None:
                victim = rng.choice(workers)
                daemons.kill(victim)
                workers.remove(victim)
                workers.append(f"w{serial}")
                daemons.start(workers[-1], *worker_args(workers[-1], args.model))
                serial += 1
                kills += 1
                print(f"t={now - began:.0f}s: killed {victim}, started {workers[-1]} "
                      f"({record.done}/{args.requests} rows)", flush=True)
                next_kill = now + args.kill_every
            daemons.check()
            time.sleep(0.5)
        wall = (rows_at or time.monotonic()) - began
        export_s = time.monotonic() - (rows_at or time.monotonic())
        figures = {"engine": f"model {args.model}" if args.model else "echo", "requests": args.requests,
                   "workers": args.workers, "kill_every_s": args.kill_every, "kills": kills,
                   "lease_seconds": args.lease_seconds, "status": record.status.value,
                   **check_rows(r, keys, job, args.requests)}
        if record.output:
            idx = pq.read_table(record.output, columns=["idx"]).column("idx").to_pylist()
            figures["parquet_rows"] = len(idx)
            figures["parquet_duplicates"] = len(idx) - len(set(idx))
            figures["parquet_lost"] = args.requests - len(set(idx))
        attempts = r.hgetall(keys.attempts(job))
        figures.update(
            attempts_counted=sum(int(v) for v in attempts.values()), requests_retried=len(attempts),
            dead_letters=r.xlen(keys.deadletter), wall_s=round(wall, 1), submit_s=round(submitted_s, 1),
            rows_per_s=round(args.requests / wall, 1) if wall else None, export_s=round(export_s, 1),
            peak_scheduler_rss_mb=round(rss_mb(scheduler.pid, "VmHWM"), 1),
            scheduler_rss_timeline=rss_timeline,
            redis_peak_mb=round(int(r.info("memory")["used_memory_peak"]) / 2**20, 1))
        return figures
    finally:
        daemons.stop_all()
        client.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200_000,
                        help="requests in the job [200000: about a minute on 2 cores with the echo engine]")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--kill-every", type=float, default=20.0, help="seconds between kills (0: none)")
    parser.add_argument("--model", help="model folder: real engine workers instead of the echo engine")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--lease-seconds", type=float, default=5.0)
    parser.add_argument("--max-attempts", type=int, default=3,
                        help="a request in flight through this many kills is dead-lettered [3]")
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--rss-every", type=float, default=20.0,
                        help="seconds between samples of the scheduler's RSS [20]")
    parser.add_argument("--redis-url", help="use this Redis instead of a private redis-server")
    parser.add_argument("--logs", help="keep the daemons' logs in this folder")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    with contextlib.ExitStack() as stack:
        logdir = Path(args.logs) if args.logs else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        logdir.mkdir(parents=True, exist_ok=True)
        url = args.redis_url or stack.enter_context(EmbeddedRedis()).url
        figures = soak(args, url, logdir)
    ok = figures["duplicates"] == 0 and figures["lost"] == 0 and figures.get("parquet_lost", 0) == 0
    for key, value in figures.items():
        print(f"{key:>24}: {value}")
    print(json.dumps({**figures, "ok": ok}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
