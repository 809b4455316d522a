"""Host overhead of one engine step: everything but the model, measured on the CPU.

A 1-layer, hidden-32 random Llama makes the tensor work of a decode step negligible, so what a
step costs here is the host path a GPU would wait on: scheduling, building inputs, sampling,
appending tokens, detokenising, stop checks and building outputs. N requests (256 and 64) decode
together; after a warm-up, ``--steps`` decode steps are timed one by one and the median is
reported, per step and per sequence-step. Three sampling modes: greedy; temperature 0.8 +
top_p 0.95; the same with a per-request seed. Besides the tokenizer's 320-token vocabulary,
49,152- and 151,936-token vocabularies (the LM head padded past the tokenizer, as real models'
are) show the sampler's cost with real vocabularies. One torch thread.

    python bench/host_overhead.py                    # every case (about a minute)
    python bench/host_overhead.py --vocabs 320       # the targets' cases only
    python bench/host_overhead.py --profile seeded   # cProfile of one case (256 running, vocab 320)

Besides wall time, each step's CPU time of this thread (``time.thread_time``) is reported: on a
machine shared with other work it leaves out the time the process waited for a core.

The last line printed is one JSON object: {case: {"us_per_step", "us_per_seq_step",
"cpu_us_per_step"}} (medians), cases named ``"{mode}/{running}/{vocab}"``.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import torch

from batchinfer.workers.config import EngineConfig
from batchinfer.workers.engine.engine import Engine
from batchinfer.workers.sampling_params import SamplingParams
from batchinfer.workers.testing import make_tiny_model

MODEL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
         "num_key_value_heads": 1, "max_position_embeddings": 1024}
MODES = {
    "greedy": {"temperature": 0.0},
    "sampled": {"temperature": 0.8, "top_p": 0.95},
    "seeded": {"temperature": 0.8, "top_p": 0.95, "seed": 0},  # seed + request number per request
}
PROMPT_LEN = 16
WARMUP = 5


def build_engine(model_dir: Path, running: int) -> Engine:
    blocks = running * ((PROMPT_LEN + WARMUP + 400) // 16 + 2)
    return Engine(EngineConfig(model=str(model_dir), num_kv_blocks=blocks, max_num_seqs=running,
                               max_num_batched_tokens=max(2048, running * PROMPT_LEN)))


def time_case(model_dir: Path, mode: str, running: int, steps: int,
              profiler: cProfile.Profile | None = None) -> tuple[list[float], list[float]]:
    """Wall and CPU (this thread's) seconds of each of ``steps`` decode steps with ``running``
    sequences decoding together."""
    engine = build_engine(model_dir, running)
    for i in range(running):
        params = dict(MODES[mode])
        if "seed" in params:
            params["seed"] = 1000 + i
        prompt = [(7 * i + j) % 300 + 3 for j in range(PROMPT_LEN)]
        engine.add_request(f"r{i}", prompt_token_ids=prompt,
                           sampling_params=SamplingParams(max_tokens=steps + WARMUP + 8, ignore_eos=True,
                                                          **params))
    engine.step()  # the prefill of every prompt (one step: the token budget holds them all)
    if engine.num_waiting:
        raise RuntimeError(f"{engine.num_waiting} requests still waiting after the prefill step")
    for _ in range(WARMUP):
        engine.step()
    times, cpu = [], []
    for _ in range(steps):
        if profiler is not None:
            profiler.enable()
        t0, c0 = time.perf_counter(), time.thread_time()
        engine.step()
        cpu.append(time.thread_time() - c0)
        times.append(time.perf_counter() - t0)
        if profiler is not None:
            profiler.disable()
    if engine.num_running != running:
        raise RuntimeError(f"{engine.num_running} sequences running, expected {running}")
    engine.close()
    return times, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--running", type=int, nargs="+", default=[256, 64])
    ap.add_argument("--vocabs", type=int, nargs="+", default=[320, 49152, 151936])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--profile", choices=list(MODES), help="cProfile this mode (256 running, first vocab)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for vocab in args.vocabs:
            model_dir = make_tiny_model(Path(tmp) / f"v{vocab}", vocab_size=vocab, **MODEL)
            if args.profile:
                prof = cProfile.Profile()
                time_case(model_dir, args.profile, args.running[0], args.steps, prof)
                pstats.Stats(prof).sort_stats("tottime").print_stats(30)
                return
            for running in args.running:
                for mode in args.modes:
                    wall, cpu = time_case(model_dir, mode, running, args.steps)
                    med, med_cpu = statistics.median(wall), statistics.median(cpu)
                    name = f"{mode}/{running}/{vocab}"
                    results[name] = {"us_per_step": round(med * 1e6, 1),
                                     "us_per_seq_step": round(med * 1e6 / running, 2),
                                     "cpu_us_per_step": round(med_cpu * 1e6, 1)}
                    print(f"{name:24s} {med * 1e6:10.1f} us/step {med * 1e6 / running:8.2f} us/seq-step "
                          f"(cpu {med_cpu * 1e6:8.1f} us/step)", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
