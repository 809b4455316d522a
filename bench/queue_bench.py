"""Queue benchmarks (issue 4): intake, queue overhead, scale. The last line printed is one JSON object.

- intake: ``Client.submit`` of a JSONL file, requests/s ÷ raw pipelined XADD of the same intake
  entries to the same Redis, in one run (best of ``--repeats`` each, interleaved). Submit adds its
  entries through the ``add_requests`` Lua script, ``SUBMIT_CHUNK`` a call, so it can beat the
  pipelined XADDs; ``raw_lua_rps`` is that script fed the prepared entries alone, and
  ``intake_ratio_lua`` (submit ÷ it) what reading, checking and chunking the file cost on top.
- overhead: one job through Redis + scheduler + one worker (subprocesses, the tiny model on CPU;
  ``--overhead-model demo`` or a model folder / .gguf file for a real one) ÷ the same requests
  through the in-process ``LLM``, same engine settings; time from submit to
  the job's ``finalizing_at`` (stamped when its last row is published). Both are timed warm
  (after one untimed run of the same requests: an engine's first steps pay one-off costs),
  interleaved, ``--overhead-repeats`` pairs; the ratio is the median of the pairs' ratios, and
  ``overhead_added_s`` the median of the seconds the queue added. Tokens are checked to be equal.
  Every request asks for ``--overhead-max-tokens`` (64), so they finish in waves; ``--overhead-varied``
  draws each one's from [max / 4, max] (seeded), so rows finish step after step, as in real jobs.
  ``--pin``: both engines get CPU 0 and one thread, the scheduler and Redis the other CPUs (a GPU
  worker's engine does not share its compute with them; on a small CPU box it otherwise does).
  Beside the ratio: the worker's engine-thread time outside its engine per request, its publisher
  and prefetch threads' CPU per request (the worker's heartbeat fields ``publisher_cpu_s`` /
  ``prefetch_cpu_s`` across each job, their idle polls between jobs included: pinned, that CPU is
  the engine's core's), and in-process ÷ the worker's seconds inside its engine. In CPU seconds
  rather than wall: the in-process run's ÷ the worker process's over the same job
  (``worker_cpu_ratio``: what the queue costs the engine's machine, steadier than the wall ratio
  when other load stretches wall time), and the scheduler's CPU per request over the job.
  Then the queue's own cost, measured in the same run: the model's worker is stopped and an echo
  worker (no model: ~25 µs of engine a request) takes its place, pinned alike, and runs the same requests
  (``--overhead-repeats`` jobs after a warm one, each row carrying as many tokens); its process's
  CPU less its time inside the echo engine, per request, is what the queue's reads, bookkeeping
  and publication cost the worker (``queue_cpu_us_per_request``, with the publisher's and prefetch
  thread's shares; beside it the engine thread's loop outside its engine, as wall time a request:
  ``queue_engine_thread_us_per_request``). Pinned, that CPU shares CPU 0
  with the engine, so the queue's time is at least the in-process time plus it:
  ``overhead_ceiling`` = in-process ÷ (in-process + that cost a job), and the bench prints the
  measured ratio against it.
- replica acks (``--replica-acks N``, issue 32): echo jobs of N requests through a scheduler and one
  echo worker on a master with one replica (two redis-servers on loopback ports), with
  ``BATCHINFER_REPLICA_ACKS`` 0 and 1 alternating: result rows/s of each and their ratio (what
  waiting for the replica costs).
- scale: echo-engine jobs of 10k and ``--scale-requests`` (default 50k; ``1000000`` for the full
  run): Redis memory per queued request (intake entries before the scheduler runs), steady
  throughput (rows per second between the first and the last result's stream ids), and the peak
  resident memory (VmHWM) of the scheduler and the worker, and the scheduler's CPU seconds per request
  (``scheduler_cpu_us_per_request``, its start-up included). Then the job's export (issue 27): a
  ``batchinfer exporter`` runs the queued Parquet export and is stopped once the job is
  ``completed``; its peak RSS is that of the exporter and its children (the rq work horse that
  exported, rq's scheduler: ``wait4``'s ``ru_maxrss``, the largest of them), printed against an
  exporter started and stopped with nothing to export and against the size of the rows' JSON in
  the results stream (what an export holding every row at once would hold, at the least).

Everything runs against a private redis-server (``batchinfer.cli.embedded``) in a temporary folder.
``python bench/queue_bench.py [--scale-requests 1000000] [--skip-overhead]``. (Not ``bench/queue.py``:
a script of that name shadows the standard library's ``queue`` for every script run from ``bench/``.)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from batchinfer.cli.embedded import EmbeddedRedis
from batchinfer.cli.runner import python_module
from batchinfer.client.client import SUBMIT_CHUNK, Client
from batchinfer.config import Settings
from batchinfer.keys import Keys
from batchinfer.protocol.entries import PROTOCOL_VERSION
from batchinfer.store import scripts

PREFIX = "{bench}"


class Daemon:
    """A ``python -m batchinfer.cli`` subprocess; its peak RSS is read before it is stopped."""

    def __init__(self, url: str, workdir: Path, *args: str, cpus: set[int] | None = None,
                 env: dict[str, str] | None = None):
        env = {**os.environ, "BATCHINFER_REDIS_URL": url, "BATCHINFER_PREFIX": PREFIX,
               "BATCHINFER_RESULTS_ROOT": str(workdir), "BATCHINFER_LOG_LEVEL": "WARNING", **(env or {})}
        self.log = open(workdir / f"{args[0]}-{time.monotonic_ns()}.log", "wb")  # noqa: SIM115
        # Pinned before exec, so every thread the daemon starts inherits the CPU set.
        pin = None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))
        self.proc = subprocess.Popen([*python_module("batchinfer.cli"), *args], env=env,
                                     stdout=self.log, stderr=subprocess.STDOUT, preexec_fn=pin)

    def cpu_s(self) -> float:
        """User + system CPU seconds the process used so far (``/proc/<pid>/stat``, every thread)."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def peak_rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def stop_peak_rss_mb(self) -> float:
        """Stop the process (SIGTERM); its peak RSS and that of every child it reaped (``ru_maxrss``
        of ``wait4``: an rq work horse is reaped by its worker, the worker's scheduler when it stops)."""
        self.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 120
        while True:
            pid, status, usage = os.wait4(self.proc.pid, os.WNOHANG)
            if pid:
                self.proc.returncode = os.waitstatus_to_exitcode(status)
                self.log.close()
                return usage.ru_maxrss / 1024  # KiB on Linux
            if time.monotonic() > deadline:
                self.proc.kill()
                deadline = float("inf")
            time.sleep(0.05)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def wait_for(cond, timeout: float, what: str, daemons: tuple[Daemon, ...] = (), poll: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        for d in daemons:
            if d.proc.poll() is not None:
                raise RuntimeError(f"{d.proc.args[3]} exited with {d.proc.returncode} (log: {d.log.name})")
        time.sleep(poll)
    raise TimeoutError(f"timed out waiting for {what}")


def job_done(r: redis.Redis, job: str) -> bool:
    return r.hget(Keys(PREFIX).job(job), "status") in (b"finalizing", b"completed")


def timed_job(r: redis.Redis, url: str, workdir: Path, records: list[dict], model: str,
              daemons: tuple[Daemon, ...]) -> tuple[float, str]:
    """Submit ``records`` as one job of ``model`` and wait for it: (seconds from the submit to its
    ``finalizing_at``, the job id)."""
    # The end is the job's `finalizing_at` (ms, stamped by the publish of its last row), not the
    # moment this loop notices it: a tighter poll would steal CPU from the daemons being timed.
    t0 = time.time()
    job = client(url, workdir).submit(records, model=model)
    wait_for(lambda: job_done(r, job), 1800, f"a job of {model}", daemons)
    return int(r.hget(Keys(PREFIX).job(job), "finalizing_at")) / 1000 - t0, job


def client(url: str, workdir: Path) -> Client:
    return Client(settings=Settings(redis_url=url, prefix=PREFIX, results_root=str(workdir)))


# -- intake -----------------------------------------------------------------------------------------


def bench_intake(url: str, workdir: Path, n: int, repeats: int) -> dict:
    r = redis.Redis.from_url(url)
    path = workdir / "intake.jsonl"
    lines = [json.dumps({"custom_id": f"r{i}", "prompt": f"Tell me about the number {i}.", "max_tokens": 16})
             for i in range(n)]
    path.write_text("\n".join(lines) + "\n")
    c = client(url, workdir)
    add_requests = scripts.register(r, "add_requests")
    best_submit = best_raw = best_lua = float("inf")
    for _ in range(repeats):
        r.flushdb()
        t0 = time.perf_counter()
        pipe = r.pipeline(transaction=False)
        for i, body in enumerate(lines):  # what submit sends, as fast as redis-py can pipeline XADDs
            pipe.xadd("raw", {"v": PROTOCOL_VERSION, "body": body, "job": "raw", "idx": i, "line": i + 1})
            if (i + 1) % SUBMIT_CHUNK == 0:
                pipe.execute()
        pipe.execute()
        best_raw = min(best_raw, time.perf_counter() - t0)
        r.flushdb()
        t0 = time.perf_counter()
        for start in range(0, n, SUBMIT_CHUNK):  # the same entries through submit's script, nothing else
            bodies = [line.encode() for line in lines[start:start + SUBMIT_CHUNK]]
            numbers = " ".join(f"{start + i} {start + i + 1} {len(b)}" for i, b in enumerate(bodies))
            add_requests(keys=["raw"], args=[PROTOCOL_VERSION, "raw", numbers, b"".join(bodies)])
        best_lua = min(best_lua, time.perf_counter() - t0)
        r.flushdb()
        t0 = time.perf_counter()
        c.submit(path, model="bench")
        best_submit = min(best_submit, time.perf_counter() - t0)
    r.flushdb()
    return {"intake_requests": n, "submit_rps": round(n / best_submit), "raw_xadd_rps": round(n / best_raw),
            "intake_ratio": round(best_raw / best_submit, 3), "raw_lua_rps": round(n / best_lua),
            "intake_ratio_lua": round(best_lua / best_submit, 3)}


# -- queue overhead -----------------------------------------------------------------------------------


def pin_process(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` onto ``cpus`` (``sched_setaffinity`` on a pid moves one thread)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        os.sched_setaffinity(int(task.name), cpus)


def bench_overhead(url: str, workdir: Path, n: int, max_tokens: int, repeats: int, device: str,
                   pin_redis_pid: int | None = None, model: str | None = None, varied: bool = False) -> dict:
    """``pin_redis_pid`` set: the engines (worker and in-process, one thread each) run on CPU 0 and
    everything else (scheduler, Redis, this process between its engine runs) on the other CPUs, as
    on a GPU worker whose engine does not share its compute with the queue's processes.
    ``model``: a model folder, a .gguf file or a name ``batchinfer run --model`` takes (``demo``);
    None: the tiny random model (hidden 64, 2 layers), whose ~1 ms of engine a request makes the
    queue's own costs weigh most. ``varied``: each request's ``max_tokens`` drawn from
    [max_tokens / 4, max_tokens] (seeded), so requests finish step after step as in real jobs, where
    equal lengths finish them in waves."""
    import torch

    from batchinfer import LLM, SamplingParams
    from batchinfer.workers.models.demo import resolve_model
    from batchinfer.workers.models.tiny import make_tiny_model

    pinned = pin_redis_pid is not None
    engine_cpus, other_cpus = {0}, set(range(1, os.cpu_count() or 1))
    if pinned:
        if not other_cpus or not hasattr(os, "sched_setaffinity"):
            raise SystemExit("--pin needs Linux and at least 2 CPUs")
        pin_process(pin_redis_pid, other_cpus)
        os.sched_setaffinity(0, other_cpus)
        torch.set_num_threads(1)

    if model is None:
        model_dir = make_tiny_model(workdir / "tiny-llama")
        served = model_dir.name
    else:
        model_dir, served = resolve_model(model)
    rnd = random.Random(0)
    prompts = [[rnd.randrange(3, 300) for _ in range(rnd.randrange(16, 64))] for _ in range(n)]
    lengths_rnd = random.Random(1)  # its own stream: the prompts stay those of the equal-length runs
    lengths = [lengths_rnd.randint(max(1, max_tokens // 4), max_tokens) if varied else max_tokens
               for _ in prompts]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in lengths]
    records = [{"custom_id": str(i), "prompt_token_ids": p, "max_tokens": m, "temperature": 0.0,
                "ignore_eos": True} for i, (p, m) in enumerate(zip(prompts, lengths, strict=True))]
    r = redis.Redis.from_url(url)
    r.flushdb()
    keys = Keys(PREFIX)
    daemons = (Daemon(url, workdir, "worker", "--model", str(model_dir), "--served-model-name", served,
                      "--device", device, "--name", "w0",
                      cpus=engine_cpus if pinned else None, env={"OMP_NUM_THREADS": "1"} if pinned else None),
               Daemon(url, workdir, "scheduler", cpus=other_cpus if pinned else None))
    llm = LLM(model_dir, device=device)  # the same engine settings as the worker's: EngineConfig's defaults

    in_cpu: list[float] = []  # this process's CPU seconds for each in-process run

    def in_process() -> tuple[float, list[list[int]]]:
        if pinned:
            os.sched_setaffinity(0, engine_cpus)
        t0, c0 = time.perf_counter(), time.process_time()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        in_cpu.append(time.process_time() - c0)
        if pinned:
            os.sched_setaffinity(0, other_cpus)
        return elapsed, [o.outputs[0].token_ids for o in outs]

    def through_queue() -> tuple[float, str]:
        return timed_job(r, url, workdir, records, served, daemons)

    try:
        wait_for(lambda: r.exists(keys.model(served)) and r.exists(keys.worker("w0")), 300,
                 "the worker to register", daemons)
        # Timed warm, interleaved pairs: an engine's first steps pay one-off costs, and
        # a shared machine's load comes and goes.
        in_process()
        through_queue()
        before = worker_loop_overhead(r, n, daemons)
        pairs, engine_s, side_s = [], [], []
        worker_cpu, scheduler_cpu = [], []  # each process's CPU seconds over a job (clock ticks: 10 ms)
        for i in range(repeats):
            t_in, expected = in_process()
            cpu0 = [d.cpu_s() for d in daemons]
            t_q, job = through_queue()
            # the worker's seconds in engine.step() / add_request for this job, and its publisher and
            # prefetch threads' CPU seconds (its heartbeat, read once it counts the job's rows:
            # outside the timed span; the threads' idle polls between jobs count too, ~1 ms)
            loop = worker_loop_overhead(r, (i + 2) * n, daemons)
            worker_cpu.append(daemons[0].cpu_s() - cpu0[0])
            scheduler_cpu.append(daemons[1].cpu_s() - cpu0[1])
            engine_s.append(float(loop["engine_s"]) - float(before["engine_s"]))
            side_s.append(sum(float(loop[k]) - float(before[k])
                              for k in ("publisher_cpu_s", "prefetch_cpu_s")))
            before = loop
            print(f"  overhead repeat {i + 1}: in-process {t_in:.2f} s, queue {t_q:.2f} s (the worker's "
                  f"engine {engine_s[-1]:.2f} s, its publisher + prefetch threads {side_s[-1] * 1e3:.0f} ms "
                  f"of CPU); CPU: in-process {in_cpu[-1]:.2f} s, worker {worker_cpu[-1]:.2f} s, scheduler "
                  f"{scheduler_cpu[-1]:.2f} s", flush=True)
            pairs.append((t_in, t_q))
        rows = [json.loads(f[b"row"]) for _, f in r.xrange(keys.results(job))]
        daemons[0].stop()  # CPU 0 for the echo worker alone
        cost = queue_cost(r, url, workdir, records, repeats, daemons[1], engine_cpus if pinned else None)
    finally:
        for d in daemons:
            d.stop()
    got = {int(row["custom_id"]): row["output_token_ids"] for row in rows}
    match = got == dict(enumerate(expected))
    r.flushdb()
    inprocess_s = statistics.median(t for t, _ in pairs)
    ratio = statistics.median(t_in / t_q for t_in, t_q in pairs)
    # pinned, one core runs the engine and the queue's CPU one after the other: the ratio this allows
    # while the worker's engine runs as fast as the in-process one (a run's noise can put it above)
    ceiling = inprocess_s / (inprocess_s + cost["queue_cpu_us_per_request"] * 1e-6 * n)
    # The ratio is the median of the per-repeat ratios: each pair ran back to back under the same load,
    # and a median is not moved by one lucky (or unlucky) run the way a best-of is.
    return {"overhead_model": model or "tiny random (hidden 64, 2 layers)", "overhead_requests": n,
            "overhead_max_tokens": max_tokens, "overhead_varied_lengths": varied, "overhead_device": device,
            "overhead_pinned": pinned,
            "inprocess_s": round(inprocess_s, 2),
            "queue_s": round(statistics.median(t for _, t in pairs), 2),
            "overhead_ratio": round(ratio, 3),
            **cost, "overhead_ceiling": round(ceiling, 3), "overhead_vs_ceiling": round(ratio / ceiling, 3),
            "overhead_added_s": round(statistics.median(t_q - t_in for t_in, t_q in pairs), 3),
            "overhead_ratio_best": round(min(t for t, _ in pairs) / min(t for _, t in pairs), 3),
            "overhead_tokens_match": match,
            "engine_thread_us_per_request": round(loop["loop_overhead_s"] / loop["requests_done"] * 1e6, 1),
            # CPU of the worker's publisher and prefetch threads per request (median job): pinned, it
            # is taken from the engine's core, so it is part of the added time
            "side_threads_us_per_request": round(statistics.median(side_s) / n * 1e6, 1),
            # the worker's seconds inside engine.step() / add_request per job ÷ the in-process run's
            # (median of the pairs): below 1, part of the added time is the engine running slower
            # beside the queue's threads; the rest is outside the engine
            "worker_engine_ratio": round(statistics.median(t_in / e for (t_in, _), e in zip(pairs, engine_s,
                                                                                           strict=True)), 3),
            # CPU seconds, not wall: the in-process run's ÷ the worker process's over the same job
            # (median of the pairs; every thread, the idle polls of the job's span included). Steadier
            # than the wall ratio on a loaded host: another VM's load stretches wall time, not CPU
            "worker_cpu_ratio": round(statistics.median(
                c / w for c, w in zip(in_cpu[-repeats:], worker_cpu, strict=True)), 3),
            "overhead_scheduler_cpu_us_per_request": round(statistics.median(scheduler_cpu) / n * 1e6, 1)}


def worker_loop_overhead(r: redis.Redis, requests: int, daemons: tuple[Daemon, ...],
                         name: str = "w0") -> dict:
    """Worker ``name``'s heartbeat once it counts ``requests`` rows: ``loop_overhead_s`` is the engine
    thread's time outside ``engine.step()`` / ``add_request`` and idle waits, over every job it ran."""
    from batchinfer.store.registry import Registry

    def info() -> dict | None:
        for w in Registry(r, Keys(PREFIX)).live_workers():
            if w.name == name and int(w.info.get("requests_done", 0)) >= requests:
                return w.info
        return None

    return wait_for(info, 60, f"a heartbeat of {name} with {requests} requests done", daemons)


def queue_cost(r: redis.Redis, url: str, workdir: Path, records: list[dict], repeats: int,
               scheduler: Daemon, engine_cpus: set[int] | None) -> dict:
    """The queue's own CPU per request on the worker: ``records`` (their prompts folded into the echo
    tokenizer's byte vocabulary, ``min_tokens`` = ``max_tokens`` so each row carries as many tokens
    as the model's did) as ``repeats`` jobs of an echo worker (after a warm one), pinned to
    ``engine_cpus``; the worker process's CPU less its seconds inside the echo engine."""
    echo = [{**rec, "prompt_token_ids": [t % 256 for t in rec["prompt_token_ids"]],
             "min_tokens": rec["max_tokens"]} for rec in records]
    worker = Daemon(url, workdir, "worker", "--echo", "--device", "cpu", "--name", "e0", cpus=engine_cpus,
                    env={"OMP_NUM_THREADS": "1"} if engine_cpus else None)
    daemons = (worker, scheduler)
    n, wall = len(records), []
    try:
        wait_for(lambda: r.exists(Keys(PREFIX).worker("e0")), 300, "the echo worker to register", daemons)
        for i in range(repeats + 1):
            if i == 1:  # the warm job's done: count from here
                before, cpu0 = worker_loop_overhead(r, n, daemons, "e0"), worker.cpu_s()
            wall.append(timed_job(r, url, workdir, echo, "echo", daemons)[0])
        after, cpu1 = worker_loop_overhead(r, (repeats + 1) * n, daemons, "e0"), worker.cpu_s()
    finally:
        worker.stop()

    def per_request(seconds: float) -> float:
        return round(seconds / (repeats * n) * 1e6, 1)

    def moved(field: str) -> float:
        return float(after[field]) - float(before[field])

    # of it, the publisher's and the prefetch thread's CPU; the rest is the engine thread's
    return {"echo_job_s": round(statistics.median(wall[1:]), 3),
            "queue_cpu_us_per_request": per_request(cpu1 - cpu0 - moved("engine_s")),
            # the engine thread's wall time outside the echo engine and idle waits (its loop's share,
            # helper threads' time slices on its core included)
            "queue_engine_thread_us_per_request": per_request(moved("loop_overhead_s")),
            "queue_publisher_us_per_request": per_request(moved("publisher_cpu_s")),
            "queue_prefetch_us_per_request": per_request(moved("prefetch_cpu_s"))}


# -- scale ----------------------------------------------------------------------------------------------


def bench_scale(url: str, workdir: Path, n: int) -> dict:
    """One echo job of ``n`` requests: Redis memory per queued request, throughput, daemon memory."""
    r = redis.Redis.from_url(url)
    r.flushdb()
    # the exporter with nothing queued: its fixed cost (interpreter, pyarrow, rq and its scheduler),
    # the floor under the export's figure. Not --burst: a burst exporter whose export outlasts rq's
    # maintenance interval starts rq's scheduler just before it exits, and can wait on it forever.
    idle = Daemon(url, workdir, "exporter")
    wait_for(lambda: exporter_ready(r), 120, "the exporter to start", (idle,))
    idle_mb = idle.stop_peak_rss_mb()
    r.flushdb()  # the nightly export it booked
    path = workdir / f"scale-{n}.jsonl"
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"custom_id": f"r{i}", "prompt": f"echo {i}", "max_tokens": 8}) + "\n")
    before = r.info("memory")["used_memory"]
    t0 = time.perf_counter()
    job = client(url, workdir).submit(path, model="echo")
    submit_s = time.perf_counter() - t0
    per_request = (r.info("memory")["used_memory"] - before) / n
    daemons = (Daemon(url, workdir, "worker", "--echo", "--device", "cpu", "--name", "echo0"),
               Daemon(url, workdir, "scheduler"))
    try:
        wait_for(lambda: job_done(r, job), 3600, f"the {n}-request echo job", daemons)
        rss = {"scheduler_rss_mb": round(daemons[1].peak_rss_mb(), 1),
               "worker_rss_mb": round(daemons[0].peak_rss_mb(), 1),
               # the scheduler's CPU (start-up included: ~1 s of imports, small next to 10k+ requests)
               "scheduler_cpu_us_per_request": round(daemons[1].cpu_s() / n * 1e6, 1)}
    finally:
        codes = [d.stop() for d in daemons]
    stream = Keys(PREFIX).results(job)
    first, last = r.xrange(stream, count=1)[0][0], r.xrevrange(stream, count=1)[0][0]
    span_s = (int(last.split(b"-")[0]) - int(first.split(b"-")[0])) / 1000
    peak = r.info("memory")["used_memory_peak"]
    export = bench_export(r, url, workdir, job, n, codes, idle_mb)
    r.flushdb()
    return {"requests": n, "submit_rps": round(n / submit_s),
            "redis_bytes_per_queued_request": round(per_request),
            "throughput_rps": round((n - 1) / span_s) if span_s > 0 else None,
            "redis_peak_mb": round(peak / 2**20), "daemon_exit_codes": codes, **rss, **export}


# -- replica acks (issue 32) -------------------------------------------------------------------------


class ReplicatedRedis:
    """A master and one replica (redis-server on free loopback ports), for the replica-acks figure."""

    def __init__(self, workdir: Path):
        import shutil
        import socket

        exe = shutil.which("redis-server")
        if exe is None:
            raise SystemExit("--replica-acks needs redis-server on PATH")
        self.procs = []
        ports = []
        for name in ("master", "replica"):
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                ports.append(sock.getsockname()[1])
            folder = workdir / f"redis-{name}"
            folder.mkdir()
            extra = ["--replicaof", "127.0.0.1", str(ports[0])] if name == "replica" else []
            self.procs.append(subprocess.Popen([exe, "--port", str(ports[-1]), "--bind", "127.0.0.1", "--dir",
                                                str(folder), "--save", "", "--appendonly", "no", *extra],
                                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        self.url = f"redis://127.0.0.1:{ports[0]}/0"
        replica = redis.Redis(port=ports[1])
        wait_for(lambda: _ping(replica) and replica.info("replication").get("master_link_status") == "up", 30,
                 "the replica to sync")

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


def _ping(r: redis.Redis) -> bool:
    try:
        return bool(r.ping())
    except redis.ConnectionError:
        return False


def bench_replica_acks(workdir: Path, n: int, repeats: int) -> dict:
    """Echo jobs of ``n`` requests through a scheduler and one echo worker on a master with one
    replica, ``BATCHINFER_REPLICA_ACKS`` 0 and 1 alternating: rows/s of each (best of ``repeats``)."""
    redis_pair = ReplicatedRedis(workdir)
    url = redis_pair.url
    r = redis.Redis.from_url(url)
    best = {0: 0.0, 1: 0.0}
    try:
        for _ in range(repeats):
            for acks in (0, 1):
                r.flushdb()
                env = {"BATCHINFER_REPLICA_ACKS": str(acks)}
                daemons = (Daemon(url, workdir, "worker", "--echo", "--device", "cpu", "--name", "echo0",
                                  env=env),
                           Daemon(url, workdir, "scheduler", env=env))
                try:
                    wait_for(lambda: r.exists(Keys(PREFIX).model("echo")), 120, "the echo worker", daemons)
                    job = client(url, workdir).submit(
                        [{"custom_id": f"r{i}", "prompt": f"echo {i}", "max_tokens": 8} for i in range(n)],
                        model="echo")
                    wait_for(lambda job=job: job_done(r, job), 3600, f"the {n}-request echo job", daemons)
                finally:
                    for d in daemons:
                        d.stop()
                stream = Keys(PREFIX).results(job)
                first, last = r.xrange(stream, count=1)[0][0], r.xrevrange(stream, count=1)[0][0]
                span_s = (int(last.split(b"-")[0]) - int(first.split(b"-")[0])) / 1000
                best[acks] = max(best[acks], (n - 1) / span_s)
    finally:
        redis_pair.stop()
    return {"replica_acks_requests": n, "rows_per_s_no_acks": round(best[0]),
            "rows_per_s_replica_acks": round(best[1]), "replica_acks_ratio": round(best[1] / best[0], 3)}


# -- several schedulers over partitions (issue 32) ---------------------------------------------------


def bench_schedulers(url: str, workdir: Path, n: int, repeats: int, redis_pid: int) -> dict:
    """Intake entries/s of one scheduler vs two over ``BATCHINFER_PARTITIONS=2``: ``n`` requests per
    partition (a job in each) are queued once the schedulers own their partitions; each partition's
    time runs from its first entry read to the moment its intake group has read and settled everything
    (validation, tokenisation, staging; no worker reads the batches, so dispatch stops at its
    backpressure and staging holds the rest). One scheduler is pinned to CPU 0; two to CPUs 0 and 1,
    one partition each; Redis is not pinned, and its CPU share is reported (what the two schedulers
    cannot have of two cores). Best of ``repeats`` each, alternating."""
    from batchinfer.store.jobstore import JobStore
    from batchinfer.store.registry import Registry
    from batchinfer.workers.models.tiny import make_tiny_model
    from batchinfer.workers.text.tokenizer_files import read_tokenizer_files

    model_dir = make_tiny_model(workdir / "tiny-llama-intake")
    r = redis.Redis.from_url(url)
    keys = Keys(PREFIX, 2)
    env = {"BATCHINFER_PARTITIONS": "2"}
    cap = {"max_model_len": 2048, "max_num_seqs": 64, "max_num_batched_tokens": 4096, "kv_tokens": 65536}
    best = {1: 0.0, 2: 0.0}
    redis_share = {1: 0.0, 2: 0.0}
    for _ in range(repeats):
        for count in (1, 2):
            r.flushdb()
            registry = Registry(r, keys)
            registry.register_model("tiny", read_tokenizer_files(model_dir), cap)
            registry.heartbeat_worker("w0", {"model": "tiny", "capacity": cap}, ttl=3600)  # nobody reads
            jobs = [next(f"p{p}-{i}" for i in range(100) if keys.job_partition(f"p{p}-{i}") == p)
                    for p in (0, 1)]
            daemons = tuple(Daemon(url, workdir, "scheduler", cpus={i}, env=env) for i in range(count))
            try:
                # the partitions spread first (a scheduler that starts alone takes both until it sees
                # the other), then the entries come, through submit's script (~370k/s: a fraction of a
                # second of the run)
                wait_for(lambda count=count: _spread(r, keys, count), 60, "each scheduler to own its share",
                         daemons)
                for job in jobs:
                    JobStore(r, keys).create(job, model="tiny")
                add_requests = scripts.register(r, "add_requests")
                spans = IntakeSpans(r, keys)
                cpu0, sched0, t0 = _cpu_s(redis_pid), sum(d.cpu_s() for d in daemons), time.perf_counter()
                for start in range(0, n, SUBMIT_CHUNK):  # the two partitions' entries interleaved
                    bodies = [json.dumps({"custom_id": f"r{i}", "prompt": f"request {i}: say something",
                                          "max_tokens": 8}).encode()
                              for i in range(start, min(n, start + SUBMIT_CHUNK))]
                    numbers = " ".join(f"{start + i} {start + i + 1} {len(b)}" for i, b in enumerate(bodies))
                    for job in jobs:
                        add_requests(keys=[keys.for_job(job).requests],
                                     args=[PROTOCOL_VERSION, job, numbers, b"".join(bodies)])
                wait_for(spans.poll, 600, "the intake", daemons, poll=0.01)
                elapsed = time.perf_counter() - t0
                share = (_cpu_s(redis_pid) - cpu0) / elapsed
                busy = (sum(d.cpu_s() for d in daemons) - sched0) / elapsed
                if not _spread(r, keys, count):
                    raise RuntimeError("the partitions changed hands during the run")
            finally:
                for d in daemons:
                    d.stop()
            rate = spans.rate(n)
            print(f"  {count} scheduler(s): {rate:,.0f} entries/s (schedulers busy {busy:.0%} of a core, "
                  f"Redis {share:.0%})", flush=True)
            if rate > best[count]:
                best[count], redis_share[count] = rate, share
    r.flushdb()
    return {"schedulers_intake_requests": 2 * n, "intake_rps_1_scheduler": round(best[1]),
            "intake_rps_2_schedulers": round(best[2]), "schedulers_ratio": round(best[2] / best[1], 3),
            "redis_core_share_2_schedulers": round(redis_share[2], 2)}


class IntakeSpans:
    """Each partition's intake span, from its first entry read to its last one settled (polled): the
    rate is the sum of the partitions' (two schedulers seldom start in the same instant, and the one
    that started later would otherwise count as idle time of both)."""

    def __init__(self, r: redis.Redis, keys: Keys):
        self.r, self.keys = r, keys
        self.starts: dict[int, float] = {}
        self.ends: dict[int, float] = {}

    def poll(self) -> bool:
        """Note what changed since the last poll; True once every partition is settled."""
        now = time.perf_counter()
        for view in self.keys.parts():
            i = view.partition
            if i not in self.starts and _entries_read(self.r, [view]) > 0:
                self.starts[i] = now
            if i in self.starts and i not in self.ends and _settled(self.r, view.requests):
                self.ends[i] = now
        return len(self.ends) == self.keys.partitions

    def rate(self, per_partition: int) -> float:
        """Entries per second, each partition holding ``per_partition``."""
        return sum(per_partition / (self.ends[i] - self.starts[i]) for i in self.starts)


def _entries_read(r: redis.Redis, views: list[Keys]) -> int:
    """Entries the intake groups of these partitions have read so far."""
    total = 0
    for view in views:
        for group in (r.xinfo_groups(view.requests) if r.exists(view.requests) else []):
            total += int(group.get("entries-read") or 0)
    return total


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _spread(r: redis.Redis, keys: Keys, count: int) -> bool:
    """Each of ``count`` schedulers owns its share of the partitions."""
    owners = {r.get(k.scheduler_owner) for k in keys.parts()}
    return len(owners) == count and None not in owners


def _settled(r: redis.Redis, stream: str) -> bool:
    """Every entry of ``stream`` settled: the intake acknowledges and deletes each one it took in."""
    groups = r.xinfo_groups(stream) if r.exists(stream) else []
    return bool(groups) and groups[0]["pending"] == 0 and r.xlen(stream) == 0


def bench_export(r: redis.Redis, url: str, workdir: Path, job: str, n: int, codes: list,
                 idle_mb: float) -> dict:
    """The finished job's queued Parquet export run by an exporter: its peak RSS (exporter, work horse,
    rq's scheduler), against ``idle_mb`` (an exporter with nothing to do) and the size of the rows' JSON."""
    import pyarrow.parquet as pq

    from batchinfer.store.jobstore import JobStore

    keys = Keys(PREFIX)
    json_bytes = 0
    for _, fields in _chunked(r, keys.results(job)):
        json_bytes += len(fields[b"row"])
    t0 = time.perf_counter()
    exporter = Daemon(url, workdir, "exporter")
    wait_for(lambda: r.hget(keys.job(job), "status") in (b"completed", b"failed"), 3600, "the export",
             (exporter,))
    export_s = time.perf_counter() - t0
    export_mb = exporter.stop_peak_rss_mb()
    codes.append(exporter.proc.returncode)
    record = JobStore(r, keys).get(job)
    if record is None or record.status != "completed" or not record.output:
        raise RuntimeError(f"the export of {job} did not complete: {record} (log: {exporter.log.name})")
    rows = pq.read_metadata(record.output).num_rows
    if rows != n:
        raise RuntimeError(f"{record.output} has {rows} rows, not {n}")
    return {"export_rss_mb": round(export_mb, 1), "exporter_idle_rss_mb": round(idle_mb, 1),
            "export_s": round(export_s, 1), "results_json_mb": round(json_bytes / 2**20, 1),
            "export_file_mb": round(os.path.getsize(record.output) / 2**20, 1)}


def exporter_ready(r: redis.Redis) -> bool:
    """An exporter has registered with rq (and so is past its start-up, waiting for jobs)."""
    from rq import Worker

    return Worker.count(connection=r) > 0


def _chunked(r: redis.Redis, stream: str, count: int = 10_000):
    start = "-"
    while True:
        entries = r.xrange(stream, min=start, max="+", count=count)
        yield from entries
        if len(entries) < count:
            return
        start = "(" + entries[-1][0].decode()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--intake-requests", type=int, default=20_000)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--overhead-requests", type=int, default=1024)
    ap.add_argument("--overhead-max-tokens", type=int, default=64)
    ap.add_argument("--overhead-varied", action="store_true",
                    help="each overhead request's max_tokens drawn from [max/4, max] (default: all max)")
    ap.add_argument("--overhead-repeats", type=int, default=5)
    ap.add_argument("--overhead-model", default=None, metavar="MODEL",
                    help="overhead bench: a model folder, .gguf file or name (demo) instead of the tiny "
                         "random model")
    ap.add_argument("--device", default="cpu", help="engine device of the overhead bench (cpu, cuda:0)")
    ap.add_argument("--pin", action="store_true",
                    help="overhead bench: engines on CPU 0 (one thread), scheduler and Redis on the others")
    ap.add_argument("--scale-requests", type=int, default=50_000)
    ap.add_argument("--replica-acks", type=int, default=0, metavar="N",
                    help="also time echo jobs of N requests on a master + replica, replica acks off vs on")
    ap.add_argument("--schedulers", type=int, default=0, metavar="N",
                    help="also time the intake of N requests per partition, 1 vs 2 schedulers, 2 partitions")
    ap.add_argument("--skip-overhead", action="store_true")
    ap.add_argument("--skip-scale", action="store_true")
    args = ap.parse_args()
    figures: dict = {}
    with EmbeddedRedis() as server, tempfile.TemporaryDirectory(prefix="bench-queue-") as tmp:
        workdir = Path(tmp)
        figures.update(bench_intake(server.url, workdir, args.intake_requests, args.repeats))
        print(f"intake: submit {figures['submit_rps']}/s vs raw pipelined XADD {figures['raw_xadd_rps']}/s "
              f"-> ratio {figures['intake_ratio']} (raw add_requests script {figures['raw_lua_rps']}/s "
              f"-> {figures['intake_ratio_lua']})", flush=True)
        if not args.skip_overhead:
            figures.update(bench_overhead(server.url, workdir, args.overhead_requests,
                                          args.overhead_max_tokens, args.overhead_repeats, args.device,
                                          pin_redis_pid=server.proc.pid if args.pin else None,
                                          model=args.overhead_model, varied=args.overhead_varied))
            print(f"overhead: in-process {figures['inprocess_s']} s vs queue {figures['queue_s']} s "
                  f"(medians) -> ratio {figures['overhead_ratio']} "
                  f"(best-of ratio {figures['overhead_ratio_best']}), added {figures['overhead_added_s']} s "
                  f"(tokens match: {figures['overhead_tokens_match']}); engine thread "
                  f"{figures['engine_thread_us_per_request']} us per request, its publisher + prefetch "
                  f"threads {figures['side_threads_us_per_request']} us of CPU per request; in-process ÷ "
                  f"the worker's time in its engine {figures['worker_engine_ratio']}; CPU: in-process ÷ "
                  f"worker {figures['worker_cpu_ratio']}, scheduler "
                  f"{figures['overhead_scheduler_cpu_us_per_request']} us per request", flush=True)
            print(f"queue's own cost: {figures['queue_cpu_us_per_request']} us of the worker's CPU a request "
                  f"(publisher thread {figures['queue_publisher_us_per_request']}, prefetch thread "
                  f"{figures['queue_prefetch_us_per_request']}, the rest the engine thread's, whose loop "
                  f"took {figures['queue_engine_thread_us_per_request']} us of wall a request; an echo "
                  f"worker, same requests: jobs of {figures['echo_job_s']} s) -> ceiling "
                  f"{figures['overhead_ceiling']} at the in-process speed"
                  f"{' (a bound: pinned, it shares the engine core)' if figures['overhead_pinned'] else ''}; "
                  f"ratio ÷ ceiling {figures['overhead_vs_ceiling']}", flush=True)
        if not args.skip_scale:
            small = bench_scale(server.url, workdir, 10_000)
            print(f"scale 10k: {small}", flush=True)
            large = bench_scale(server.url, workdir, args.scale_requests)
            print(f"scale {args.scale_requests}: {large}", flush=True)
            figures.update({
                "scale_requests": args.scale_requests,
                "throughput_10k_rps": small["throughput_rps"],
                "throughput_large_rps": large["throughput_rps"],
                "throughput_ratio": round(large["throughput_rps"] / small["throughput_rps"], 3),
                "redis_bytes_per_queued_request": large["redis_bytes_per_queued_request"],
                "redis_peak_mb": large["redis_peak_mb"],
                "scheduler_rss_mb": large["scheduler_rss_mb"], "worker_rss_mb": large["worker_rss_mb"],
                "scheduler_rss_10k_mb": small["scheduler_rss_mb"],
                "scheduler_cpu_us_per_request": large["scheduler_cpu_us_per_request"],
                "scheduler_cpu_us_per_request_10k": small["scheduler_cpu_us_per_request"],
                "worker_rss_10k_mb": small["worker_rss_mb"],
                "export_rss_mb": large["export_rss_mb"], "export_rss_10k_mb": small["export_rss_mb"],
                "exporter_idle_rss_mb": large["exporter_idle_rss_mb"],
                "results_json_mb": large["results_json_mb"], "export_s": large["export_s"],
            })
            print(f"export of {args.scale_requests} rows: peak RSS {large['export_rss_mb']} MB (10k rows: "
                  f"{small['export_rss_mb']} MB; the exporter with nothing to export: "
                  f"{large['exporter_idle_rss_mb']} MB; the rows' JSON in the stream: "
                  f"{large['results_json_mb']} MB), {large['export_s']} s", flush=True)
        if args.schedulers:
            figures.update(bench_schedulers(server.url, workdir, args.schedulers, args.repeats,
                                            server.proc.pid))
            print(f"schedulers: intake {figures['intake_rps_2_schedulers']:,}/s with 2 schedulers over 2 "
                  f"partitions vs {figures['intake_rps_1_scheduler']:,}/s with one -> ratio "
                  f"{figures['schedulers_ratio']} (Redis took "
                  f"{figures['redis_core_share_2_schedulers']:.0%} of a core beside the two)", flush=True)
        if args.replica_acks:
            figures.update(bench_replica_acks(workdir, args.replica_acks, args.repeats))
            print(f"replica acks: {figures['rows_per_s_replica_acks']} rows/s with BATCHINFER_REPLICA_ACKS=1 "
                  f"vs {figures['rows_per_s_no_acks']} without -> ratio {figures['replica_acks_ratio']}",
                  flush=True)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
