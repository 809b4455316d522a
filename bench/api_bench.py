"""HTTP API benchmark (issue 30): the API against its peers, in one run. The last line printed is one
JSON object.

- batch: the same ``--lines`` OpenAI chat lines (default 10,000) through the ``openai`` SDK (upload,
  create, poll every 0.5 s, download the output file) ÷ ``batchinfer submit`` + ``batchinfer wait``
  (which polls every 0.5 s) + ``batchinfer results`` of the same file (subprocesses, as a user types
  them). ``batch_ratio`` = CLI seconds ÷ SDK seconds (the SDK's speed relative to the CLI's; target
  ≥ 0.95), the median of ``--repeats`` interleaved pairs (order alternating).
- upload: a ``--upload-mb`` file (default 100 MB of JSONL) through ``POST /v1/files`` (the SDK's
  ``files.create``), MB/s ÷ ``shutil.copyfile`` of the same file into the same folder (the plain
  copy ``cp`` makes); best of ``--repeats`` each, interleaved.
- sync: ``--concurrency`` (64) threads each sending chat requests back to back, ``--sync-requests``
  in all per round: the SDK's ``chat.completions.create`` through the API ÷ ``Client.request`` of
  the same body straight on the queue; p50 and p99 latency of each and the differences (the
  API's added latency), over ``--repeats`` interleaved rounds after an untimed warm-up round each.

Everything runs on the CPU with echo workers, so it measures the API and the queue, not a model:
a private redis-server (``batchinfer.cli.embedded``; or ``--redis-url``, a Redis of its own: rq's
queue name is global), scheduler, exporter, ``--workers`` echo workers and ``batchinfer api`` as
subprocesses, in a temporary folder. Never a CI step.

``.venv/bin/python -P bench/api_bench.py [--lines 10000] [--upload-mb 100] [--quick]``
(``--quick``: 500 lines, 5 MB, 256 sync requests, one repeat: a smoke run of a few seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import tempfile
import threading
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import redis

from batchinfer.cli.embedded import EmbeddedRedis
from batchinfer.cli.runner import python_module
from batchinfer.client.client import Client
from batchinfer.config import Settings
from batchinfer.keys import Keys
from batchinfer.store.apikeys import ApiKeys
from batchinfer.store.registry import Registry

CHAT = "/v1/chat/completions"
MODEL = "echo"
POLL_S = 0.5  # the SDK side's poll, as `batchinfer wait`'s (Client.wait's default)
CLI = python_module("batchinfer.cli")
ENDED = ("completed", "failed", "expired", "cancelled")


class Stack:
    """The daemons, as ``python -m batchinfer.cli`` subprocesses with their logs in ``workdir``."""

    def __init__(self, url: str, workdir: Path, workers: int):
        self.workdir = workdir
        self.prefix = f"{{api{uuid.uuid4().hex[:6]}}}"
        self.env = {**os.environ, "BATCHINFER_REDIS_URL": url, "BATCHINFER_PREFIX": self.prefix,
                    "BATCHINFER_RESULTS_ROOT": str(workdir / "results"),
                    "BATCHINFER_FILES_DIR": str(workdir / "files"), "BATCHINFER_LOG_LEVEL": "WARNING"}
        self.settings = Settings(redis_url=url, prefix=self.prefix, results_root=str(workdir / "results"))
        self.redis = redis.Redis.from_url(url)
        self.keys = Keys(self.prefix)
        self.procs: dict[str, subprocess.Popen] = {}
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.start("scheduler", "scheduler")
        self.start("exporter", "exporter")
        for i in range(workers):
            self.start(f"echo{i}", "worker", "--echo", "--device", "cpu", "--name", f"echo{i}")
        self.start("api", "api", "--port", str(self.port))
        registry = Registry(self.redis, self.keys)
        self.until(lambda: len(registry.live_workers()) >= workers, 120, "the echo workers")
        self.until(self._ready, 60, "the API's /readyz")
        self.secret, _ = ApiKeys(self.redis, self.keys).create("bench")

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, name: str, *args: str) -> None:
        with open(self.workdir / f"{name}.log", "ab") as log:
            self.procs[name] = subprocess.Popen([*CLI, *args], env=self.env, stdout=log,
                                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                cwd=self.workdir)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/readyz", timeout=2) as reply:
                return reply.status == 200
        except OSError:
            return False

    def until(self, cond, timeout: float, what: str, poll: float = 0.05):
        deadline = time.monotonic() + timeout
        while True:
            value = cond()
            if value:
                return value
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}: {self.log_tail(name)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}")
            time.sleep(poll)

    def log_tail(self, name: str) -> str:
        lines = (self.workdir / f"{name}.log").read_text(errors="replace").splitlines()
        return " | ".join(lines[-5:])

    def cli(self, *args: str) -> str:
        proc = subprocess.run([*CLI, *args], env=self.env, capture_output=True, text=True, cwd=self.workdir,
                              timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(f"batchinfer {' '.join(args)} exited {proc.returncode}: {proc.stderr[-2000:]}")
        return proc.stdout

    def openai(self):
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key=self.secret, max_retries=0, timeout=600)

    def close(self) -> None:
        for proc in self.procs.values():
            proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def chat_body(i: int) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": f"Tell me about the number {i}."}],
            "max_tokens": 8}


# -- batch: SDK vs CLI -----------------------------------------------------------------------------------


def write_batch_file(path: Path, n: int) -> None:
    with path.open("w") as f:
        for i in range(n):
            line = {"custom_id": f"r{i}", "method": "POST", "url": CHAT, "body": chat_body(i)}
            f.write(json.dumps(line) + "\n")


def through_sdk(stack: Stack, path: Path, n: int) -> float:
    client = stack.openai()
    t0 = time.perf_counter()
    with path.open("rb") as f:
        uploaded = client.files.create(file=(path.name, f), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
    while batch.status not in ENDED:
        time.sleep(POLL_S)
        batch = client.batches.retrieve(batch.id)
    content = client.files.content(batch.output_file_id).content
    elapsed = time.perf_counter() - t0
    lines = content.count(b"\n")
    if batch.status != "completed" or lines != n:
        raise RuntimeError(f"SDK batch {batch.id}: {batch.status}, {lines} output lines of {n}")
    return elapsed


def through_cli(stack: Stack, path: Path, n: int, run: int) -> float:
    out, err = stack.workdir / f"cli-out-{run}.jsonl", stack.workdir / f"cli-err-{run}.jsonl"
    t0 = time.perf_counter()
    job = json.loads(stack.cli("submit", str(path), "--format", "openai", "--json", "-q"))["job_id"]
    stack.cli("wait", job, "-q")
    stack.cli("results", job, "-o", str(out), "--format", "openai", "--error-file", str(err), "-q")
    elapsed = time.perf_counter() - t0
    lines = out.read_bytes().count(b"\n")
    if lines != n:
        raise RuntimeError(f"CLI job {job}: {lines} output lines of {n}")
    return elapsed


def bench_batch(stack: Stack, n: int, repeats: int) -> dict:
    path = stack.workdir / "batch.jsonl"
    write_batch_file(path, n)
    pairs = []
    for i in range(repeats):
        if i % 2 == 0:  # alternate the order: a shared machine's load comes and goes
            cli_s, sdk_s = through_cli(stack, path, n, i), through_sdk(stack, path, n)
        else:
            sdk_s, cli_s = through_sdk(stack, path, n), through_cli(stack, path, n, i)
        print(f"  batch repeat {i + 1}: SDK {sdk_s:.2f} s, CLI {cli_s:.2f} s", flush=True)
        pairs.append((sdk_s, cli_s))
    return {"batch_lines": n, "batch_sdk_s": round(statistics.median(s for s, _ in pairs), 2),
            "batch_cli_s": round(statistics.median(c for _, c in pairs), 2),
            "batch_ratio": round(statistics.median(c / s for s, c in pairs), 3)}


# -- upload: POST /v1/files vs a plain copy -------------------------------------------------------------


def write_upload_file(path: Path, mb: int) -> int:
    line = json.dumps({"custom_id": "x" * 8, "method": "POST", "url": CHAT, "body": chat_body(0)}) + "\n"
    block = (line * ((1 << 20) // len(line) + 1)).encode()[: 1 << 20]
    with path.open("wb") as f:
        for _ in range(mb):
            f.write(block)
    return mb << 20


def bench_upload(stack: Stack, mb: int, repeats: int) -> dict:
    path = stack.workdir / "upload.jsonl"
    size = write_upload_file(path, mb)
    folder = stack.workdir / "files"
    folder.mkdir(exist_ok=True)
    client = stack.openai()
    best_up = best_copy = float("inf")
    for i in range(repeats):
        t0 = time.perf_counter()
        with path.open("rb") as f:
            uploaded = client.files.create(file=(path.name, f), purpose="user_data")
        best_up = min(best_up, time.perf_counter() - t0)
        if uploaded.bytes != size:
            raise RuntimeError(f"uploaded {uploaded.bytes} bytes of {size}")
        client.files.delete(uploaded.id)
        t0 = time.perf_counter()
        shutil.copyfile(path, folder / f"copy-{i}")
        best_copy = min(best_copy, time.perf_counter() - t0)
        (folder / f"copy-{i}").unlink()
    up, copy = size / 2**20 / best_up, size / 2**20 / best_copy
    return {"upload_mb": mb, "upload_mb_s": round(up, 1), "copy_mb_s": round(copy, 1),
            "upload_ratio": round(up / copy, 3)}


# -- sync: the endpoint vs Client.request ----------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def latencies(send, total: int, concurrency: int) -> list[float]:
    """``send(i)`` for i < ``total`` from ``concurrency`` threads, each sending back to back; seconds each."""
    times: list[float] = []
    lock = threading.Lock()

    def timed(i: int) -> None:
        t0 = time.perf_counter()
        send(i)
        elapsed = time.perf_counter() - t0
        with lock:
            times.append(elapsed)

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(timed, range(total)))
    return times


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU seconds of this process (the load generator) and of the API process over timed rounds."""

    def __init__(self, api_pid: int):
        self.api_pid = api_pid
        self.own = self.api = 0.0

    def run(self, fn, *args):
        own0, api0 = time.process_time(), cpu_s(self.api_pid)
        try:
            return fn(*args)
        finally:
            self.own += time.process_time() - own0
            self.api += cpu_s(self.api_pid) - api0


def bench_sync(stack: Stack, total: int, concurrency: int, repeats: int) -> dict:
    sdk = stack.openai()
    client = Client(settings=stack.settings)

    def via_api(i: int) -> None:
        chat = sdk.chat.completions.create(**chat_body(i))
        if chat.choices[0].finish_reason is None:
            raise RuntimeError(f"no answer: {chat}")

    def via_client(i: int) -> None:
        row = client.request({"custom_id": f"s{i}", "method": "POST", "url": CHAT, "body": chat_body(i)},
                             timeout=120)
        if row.status != "completed":
            raise RuntimeError(f"request {i}: {row.status} {row.error_message}")

    latencies(via_client, concurrency, concurrency)  # warm-up: connections, the worker's first steps
    latencies(via_api, concurrency, concurrency)
    api_times: list[float] = []
    client_times: list[float] = []
    api_cpu, client_cpu = CpuMeter(stack.procs["api"].pid), CpuMeter(stack.procs["api"].pid)
    for i in range(repeats):
        if i % 2 == 0:
            client_times += client_cpu.run(latencies, via_client, total, concurrency)
            api_times += api_cpu.run(latencies, via_api, total, concurrency)
        else:
            api_times += api_cpu.run(latencies, via_api, total, concurrency)
            client_times += client_cpu.run(latencies, via_client, total, concurrency)
    # one at a time: the added latency without queueing behind the other requests' CPU
    serial_api = latencies(via_api, concurrency, 1)
    serial_client = latencies(via_client, concurrency, 1)
    client.close()
    n = len(api_times)
    # where a 2-core box's time goes: the load generator's CPU per request (the SDK's or the
    # Client's side) and the API server's
    figures = {"sync_concurrency": concurrency, "sync_requests": n,
               "sync_sdk_cpu_ms_per_request": round(api_cpu.own / n * 1000, 2),
               "sync_client_cpu_ms_per_request": round(client_cpu.own / n * 1000, 2),
               "sync_api_server_cpu_ms_per_request": round(api_cpu.api / n * 1000, 2),
               "serial_api_p50_ms": round(percentile(serial_api, 0.5) * 1000, 1),
               "serial_client_p50_ms": round(percentile(serial_client, 0.5) * 1000, 1)}
    for name, q in (("p50", 0.5), ("p99", 0.99)):
        api_ms, client_ms = percentile(api_times, q) * 1000, percentile(client_times, q) * 1000
        figures.update({f"sync_api_{name}_ms": round(api_ms, 1),
                        f"sync_client_{name}_ms": round(client_ms, 1),
                        f"sync_added_{name}_ms": round(api_ms - client_ms, 1)})
    return figures


def report(figures: dict, args: argparse.Namespace) -> None:
    f = figures
    print(f"batch of {args.lines} lines: SDK {f['batch_sdk_s']} s vs CLI {f['batch_cli_s']} s (medians) "
          f"-> ratio {f['batch_ratio']} (CLI s / SDK s; target >= 0.95)", flush=True)
    print(f"upload of {args.upload_mb} MB: POST /v1/files {f['upload_mb_s']} MB/s vs copy {f['copy_mb_s']} "
          f"MB/s -> ratio {f['upload_ratio']}", flush=True)
    print(f"sync at {args.concurrency} concurrent: API p50 {f['sync_api_p50_ms']} ms, p99 "
          f"{f['sync_api_p99_ms']} ms; Client.request p50 {f['sync_client_p50_ms']} ms, p99 "
          f"{f['sync_client_p99_ms']} ms; added p50 {f['sync_added_p50_ms']} ms, p99 "
          f"{f['sync_added_p99_ms']} ms", flush=True)
    print(f"sync one at a time: API p50 {f['serial_api_p50_ms']} ms vs Client.request p50 "
          f"{f['serial_client_p50_ms']} ms; CPU per request at {args.concurrency}: SDK side "
          f"{f['sync_sdk_cpu_ms_per_request']} ms, Client side {f['sync_client_cpu_ms_per_request']} ms, "
          f"API server {f['sync_api_server_cpu_ms_per_request']} ms", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lines", type=int, default=10_000, help="lines of the batch file")
    ap.add_argument("--upload-mb", type=int, default=100, help="size of the uploaded file")
    ap.add_argument("--sync-requests", type=int, default=1024, help="synchronous requests per side per round")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", type=int, default=1, help="echo workers")
    ap.add_argument("--redis-url", help="a Redis of its own (default: a private embedded redis-server)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 500 lines, 5 MB, 256 requests, once")
    args = ap.parse_args()
    if args.quick:
        args.lines, args.upload_mb, args.sync_requests, args.repeats = 500, 5, 256, 1
    figures: dict = {}
    embedded = None if args.redis_url else EmbeddedRedis().start()
    url = args.redis_url or embedded.url
    with tempfile.TemporaryDirectory(prefix="bench-api-") as tmp:
        stack = Stack(url, Path(tmp), args.workers)
        try:
            figures.update(bench_batch(stack, args.lines, args.repeats))
            figures.update(bench_upload(stack, args.upload_mb, args.repeats))
            figures.update(bench_sync(stack, args.sync_requests, args.concurrency, args.repeats))
        finally:
            stack.close()
            if embedded is not None:
                embedded.stop()
    report(figures, args)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
