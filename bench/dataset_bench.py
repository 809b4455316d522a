"""Dataset intake benchmarks (issue 31). The last line printed is one JSON object.

- intake: ``Client.submit`` of a Hive-partitioned Parquet dataset in an S3-compatible store (moto's
  server on a loopback port, as in the tests) with a prompt template and ``keep_columns``: rows/s
  into the intake stream, against a bare pyarrow scan of the same files from the same store in the
  same run, reading the columns the submit reads (``scan_pylist``: record batches turned into
  Python values, what any producer of JSON requests has to do; ``scan_arrow``: batches left in
  Arrow, the store's and Parquet's own speed), and against Redis's own intake ceiling (``redis_add``:
  the very entries the submit wrote, read back and added again through the submit's
  ``add_requests`` script with nothing else to do). Best of ``--repeats`` each, interleaved.
- memory: the peak RSS (``ru_maxrss``) of a process that submits a local dataset of
  ``--memory-rows`` rows (default 1,000,000; ``10000000`` for the full run) against one that submits
  100,000 rows, with the same template and kept columns: flat when the submit streams.
- scheduler: the scheduler's peak RSS (VmHWM) after it took in a dataset job of ``--scheduler-rows``
  rows (answered by an echo worker) against one of 10,000 rows.

``python bench/dataset_bench.py [--rows 200000] [--memory-rows 10000000]``. Everything runs against a
private redis-server and a private moto server in a temporary folder.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import redis

from batchinfer.cli.embedded import EmbeddedRedis
from batchinfer.cli.runner import python_module
from batchinfer.client.client import SUBMIT_CHUNK, Client
from batchinfer.config import Settings
from batchinfer.datasets.source import DatasetSource
from batchinfer.datasets.templates import RequestTemplate
from batchinfer.keys import Keys
from batchinfer.protocol.entries import PROTOCOL_VERSION
from batchinfer.store import scripts

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from s3_server import S3Server  # noqa: E402 - the tests' moto server

PREFIX = "{dsbench}"
TEMPLATE = "Summarise in {{ lang }}: {{ title }}\n\n{{ body }}"
COLUMNS = ["title", "body", "lang", "id", "date"]  # what the template and the kept columns read
DAYS = 4
WORDS = ["lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit", "sed", "do",
         "eiusmod", "tempor", "incididunt", "ut", "labore", "et", "dolore", "magna", "aliqua"]


def write_dataset(root: str, rows: int, filesystem=None) -> None:
    """``rows`` rows over :data:`DAYS` Hive partitions ``date=2026-12-0N``, 64k-row files."""
    per_day = rows // DAYS
    file_rows = 65_536
    for day in range(DAYS):
        start = day * per_day
        n = per_day if day < DAYS - 1 else rows - start
        for first in range(0, n, file_rows):
            ids = list(range(start + first, start + min(first + file_rows, n)))
            table = pa.table({
                "id": pa.array(ids, pa.int64()),
                "title": [f"item {i} {WORDS[i % len(WORDS)]}" for i in ids],
                "body": [" ".join(WORDS[(i + k) % len(WORDS)] for k in range(30)) for i in ids],
                "lang": ["en" if i % 3 else "fr" for i in ids],
            })
            path = f"{root}/date=2026-12-{day + 1:02d}/part-{first // file_rows}.parquet"
            if filesystem is None:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(table, path, filesystem=filesystem)


def scan(uri: str, to_python: bool) -> int:
    dataset = pads.dataset(uri, format="parquet", partitioning="hive")
    n = 0
    for batch in dataset.to_batches(columns=COLUMNS, batch_size=4096):
        if to_python:
            for column in batch.columns:
                column.to_pylist()
        n += batch.num_rows
    return n


def settings(url: str, workdir: Path) -> Settings:
    return Settings(redis_url=url, prefix=PREFIX, results_root=str(workdir / "results"),
                    files_dir=str(workdir / "files"))


def submit(url: str, workdir: Path, uri: str) -> tuple[str, int]:
    with Client(settings=settings(url, workdir)) as client:
        job = client.submit(DatasetSource(uri), model="bench", keep_columns=["id", "date"],
                            template=RequestTemplate.from_text(TEMPLATE, prompt_as="prompt"))
        return job, client.status(job).total or 0


def redis_add(r: redis.Redis, bodies: list[bytes]) -> None:
    """The intake ceiling: ``bodies`` added as a job's entries through the submit's own script."""
    add_requests = scripts.register(r, "add_requests")
    for start in range(0, len(bodies), SUBMIT_CHUNK):
        chunk = bodies[start:start + SUBMIT_CHUNK]
        numbers = " ".join(f"{start + i} {start + i + 1} {len(b)}" for i, b in enumerate(chunk))
        add_requests(keys=["raw"], args=[PROTOCOL_VERSION, "raw", numbers, b"".join(chunk)])


def bench_intake(url: str, workdir: Path, rows: int, repeats: int) -> dict:
    server = S3Server(workdir).start()
    try:
        os.environ.update(server.env())
        server.make_bucket("bench")
        import pyarrow.fs as pafs

        fs, _ = pafs.FileSystem.from_uri("s3://bench/x")
        write_dataset("bench/events", rows, fs)
        uri = "s3://bench/events/"
        r = redis.Redis.from_url(url)
        _, n = submit(url, workdir, uri)  # the entries the ceiling adds again
        bodies = [fields[b"body"] for _, fields in r.xrange(Keys(PREFIX).requests) if b"body" in fields]
        assert len(bodies) == rows, (len(bodies), rows)
        best = {"submit": float("inf"), "scan_pylist": float("inf"), "scan_arrow": float("inf"),
                "redis_add": float("inf")}
        for _ in range(repeats):
            for name in best:
                r.flushdb()
                t0 = time.perf_counter()
                if name == "submit":
                    _, n = submit(url, workdir, uri)
                elif name == "redis_add":
                    redis_add(r, bodies)
                    n = len(bodies)
                else:
                    n = scan(uri, to_python=name == "scan_pylist")
                best[name] = min(best[name], time.perf_counter() - t0)
                assert n == rows, (name, n, rows)
        r.flushdb()
    finally:
        server.stop()
    rps = {name: round(rows / seconds) for name, seconds in best.items()}
    return {"intake_rows": rows, "submit_rows_s": rps["submit"], "scan_pylist_rows_s": rps["scan_pylist"],
            "scan_arrow_rows_s": rps["scan_arrow"], "redis_add_rows_s": rps["redis_add"],
            "ratio_vs_redis_add": round(best["redis_add"] / best["submit"], 3),
            "ratio_vs_pylist_scan": round(best["scan_pylist"] / best["submit"], 3),
            "ratio_vs_arrow_scan": round(best["scan_arrow"] / best["submit"], 3)}


def _submit_child(url: str, workdir: str, root: str) -> None:
    """Run in a child process: submit the local dataset at ``root``; print the peak RSS (MB)."""
    job, n = submit(url, Path(workdir), root)
    print(json.dumps({"rows": n, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def submit_rss(url: str, workdir: Path, rows: int) -> dict:
    root = workdir / f"local-{rows}"
    if not root.exists():
        write_dataset(str(root), rows)
    redis.Redis.from_url(url).flushdb()
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-P", __file__, "--child", url, str(workdir), str(root)],
                          capture_output=True, text=True, check=True)
    seconds = time.perf_counter() - t0
    out = json.loads(done.stdout.strip().splitlines()[-1])
    redis.Redis.from_url(url).flushdb()
    return {**out, "seconds": round(seconds, 1)}


def bench_memory(url: str, workdir: Path, rows: int) -> dict:
    small, large = submit_rss(url, workdir, 100_000), submit_rss(url, workdir, rows)
    assert small["rows"] == 100_000 and large["rows"] == rows
    return {"memory_rows": rows, "submit_rss_100k_mb": round(small["peak_rss_mb"], 1),
            "submit_rss_mb": round(large["peak_rss_mb"], 1),
            "submit_rss_ratio": round(large["peak_rss_mb"] / small["peak_rss_mb"], 3),
            "submit_rows_s_local": round(rows / large["seconds"])}


def scheduler_rss(url: str, workdir: Path, rows: int) -> float:
    """Peak RSS (MB) of a scheduler that took in a dataset job of ``rows`` rows, answered by echo."""
    redis.Redis.from_url(url).flushdb()
    env = {**os.environ, "BATCHINFER_REDIS_URL": url, "BATCHINFER_PREFIX": PREFIX,
           "BATCHINFER_RESULTS_ROOT": str(workdir / "results"), "BATCHINFER_LOG_LEVEL": "WARNING"}
    cli = python_module("batchinfer.cli")
    procs = [subprocess.Popen([*cli, *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for args in (["scheduler"], ["worker", "--echo", "--served-model-name", "bench", "--name", "w",
                                          "--engine-option", "requests_per_step=256",
                                          "--engine-option", "max_num_seqs=256"])]
    try:
        root = workdir / f"local-{rows}"
        if not root.exists():
            write_dataset(str(root), rows)
        job, _ = submit(url, workdir, str(root))
        r = redis.Redis.from_url(url)
        key = Keys(PREFIX).job(job)
        deadline = time.monotonic() + 3600
        while r.hget(key, "status") not in (b"finalizing", b"completed"):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"job {job} did not finish")
            time.sleep(0.5)
        status = Path(f"/proc/{procs[0].pid}/status").read_text()
        return int(next(x for x in status.splitlines() if x.startswith("VmHWM")).split()[1]) / 1024
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=60)


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        _submit_child(*sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=200_000, help="rows of the S3 intake dataset")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--memory-rows", type=int, default=1_000_000)
    ap.add_argument("--scheduler-rows", type=int, default=100_000)
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--skip-scheduler", action="store_true")
    args = ap.parse_args()
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="dataset-bench-") as tmp, EmbeddedRedis() as rds:
        workdir = Path(tmp)
        out.update(bench_intake(rds.url, workdir, args.rows, args.repeats))
        print(json.dumps(out), flush=True)
        if not args.skip_memory:
            out.update(bench_memory(rds.url, workdir, args.memory_rows))
            print(json.dumps(out), flush=True)
        if not args.skip_scheduler:
            small, large = scheduler_rss(rds.url, workdir, 10_000), scheduler_rss(rds.url, workdir,
                                                                                 args.scheduler_rows)
            out.update({"scheduler_rows": args.scheduler_rows, "scheduler_rss_10k_mb": round(small, 1),
                        "scheduler_rss_mb": round(large, 1)})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
