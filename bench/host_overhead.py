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
    python bench/host_overhead.py --device cuda --vocabs 49152 --modes greedy sampled  # GPU idle time

With ``--device cuda`` (bfloat16 on the GPU, CUDA graphs for decode) each step also reports
``gpu_busy``, the device time from the model runner's first kernel to the sampler's last (CUDA
events), and ``gpu_idle``, the step's wall time less that: how long the GPU waited on the host
for the step (bench/gpu_check.sh's ``host`` section).

Besides wall time, each step's CPU time of this thread (``time.thread_time``) is reported: on a
machine shared with other work it leaves out the time the process waited for a core.

Each case also reports the median CPU time per step of each engine stage (the scheduler's plan,
the step's inputs, the model's forward + LM head, the sampler, postprocessing), so that a change
to one stage shows through the noise of a shared machine, and ``host``: the step's CPU time less
the forward's. On this CPU even the 1-layer model's forward is not negligible (paged decode
attention over 256 sequences is ~1 ms of torch ops); on a GPU it is device work the host
overlaps or waits on, so ``host`` is the part of the step a GPU would wait on (the sampler's
tensor ops included, which a GPU would also run). ``--output-kind final_only`` runs the requests
as the worker daemon does (no per-step ``RequestOutput``).

The last line printed is one JSON object: {case: {"us_per_step", "us_per_seq_step",
"cpu_us_per_step", "stages_cpu_us"}} (medians), cases named ``"{mode}/{running}/{vocab}"``.
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
from typing import Any

import torch

from batchinfer.workers.engine.engine import Engine
from batchinfer.workers.engine_config import EngineConfig
from batchinfer.workers.models.tiny import make_tiny_model
from batchinfer.workers.sampling_params import SamplingParams

MODEL: dict[str, Any] = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                         "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 1024}
MODES: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "sampled": {"temperature": 0.8, "top_p": 0.95},
    "seeded": {"temperature": 0.8, "top_p": 0.95, "seed": 0},  # seed + request number per request
}
PROMPT_LEN = 16
WARMUP = 5


def build_engine(model_dir: Path, running: int, device: str = "cpu") -> Engine:
    blocks = running * ((PROMPT_LEN + WARMUP + 400) // 16 + 2)
    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    return Engine(EngineConfig(model=str(model_dir), num_kv_blocks=blocks, max_num_seqs=running,
                               max_num_batched_tokens=max(2048, running * PROMPT_LEN),
                               device=device, dtype=dtype))


STAGES = ("schedule", "prepare", "forward", "sample", "postprocess")


class StageClock:
    """This thread's CPU seconds in each engine stage of the current step: the scheduler's plan,
    the step's input arrays and tensors (``ModelRunner.prepare``), the model's forward and LM head
    (the rest of ``ModelRunner.execute``: what a GPU runs), the sampler, and postprocessing
    (tokens, text, stops, outputs); wrapped around the engine's own members."""

    def __init__(self, engine: Engine) -> None:
        self.spent = dict.fromkeys((*STAGES, "execute"), 0.0)
        engine.scheduler.schedule = self._wrap("schedule", engine.scheduler.schedule)  # type: ignore[method-assign]
        engine.runner.execute = self._wrap("execute", engine.runner.execute)  # type: ignore[method-assign]
        engine.runner.prepare = self._wrap("prepare", engine.runner.prepare)  # type: ignore[method-assign]
        engine.sampler = self._wrap("sample", engine.sampler)
        out = engine.output_processor
        out.postprocess = self._wrap("postprocess", out.postprocess)  # type: ignore[method-assign]

    def _wrap(self, stage: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[stage] += time.thread_time() - t0
        return timed

    def take(self) -> dict[str, float]:
        """The step's seconds per stage (then zeroed)."""
        spent, self.spent = self.spent, dict.fromkeys((*STAGES, "execute"), 0.0)
        spent["forward"] = spent.pop("execute") - spent["prepare"]
        return spent


class DeviceClock:
    """CUDA: the device time of each step's kernels, from an event recorded as the model runner
    starts to one recorded as the sampler returns (its ``.tolist()`` has synchronised by then).
    The step's wall time less this is what the GPU spent waiting on the host."""

    def __init__(self, engine: Engine) -> None:
        self.begin = self.end = None
        execute, sample = engine.runner.execute, engine.sampler

        def timed_execute(*args: Any, **kwargs: Any) -> Any:
            self.begin = torch.cuda.Event(enable_timing=True)
            self.begin.record()
            return execute(*args, **kwargs)

        def timed_sample(*args: Any, **kwargs: Any) -> Any:
            out = sample(*args, **kwargs)
            self.end = torch.cuda.Event(enable_timing=True)
            self.end.record()
            return out

        engine.runner.execute = timed_execute  # type: ignore[method-assign]
        engine.sampler = timed_sample  # type: ignore[assignment]

    def take(self) -> float:
        """Device seconds of the step just run (0 for a step that ran nothing)."""
        if self.begin is None or self.end is None:
            return 0.0
        self.end.synchronize()
        seconds = self.begin.elapsed_time(self.end) / 1e3
        self.begin = self.end = None
        return seconds


def time_case(model_dir: Path, mode: str, running: int, steps: int, output_kind: str = "cumulative",
              profiler: cProfile.Profile | None = None,
              device: str = "cpu") -> tuple[list[float], list[float], dict[str, float]]:
    """Wall and CPU (this thread's) seconds of each of ``steps`` decode steps with ``running``
    sequences decoding together, and each stage's median CPU seconds per step (on CUDA also
    ``gpu_busy`` and ``gpu_idle``: the step's device time and its wall time less that)."""
    engine = build_engine(model_dir, running, device)
    for i in range(running):
        params = dict(MODES[mode])
        if "seed" in params:
            params["seed"] = 1000 + i
        prompt = [(7 * i + j) % 300 + 3 for j in range(PROMPT_LEN)]
        engine.add_request(f"r{i}", prompt_token_ids=prompt,
                           sampling_params=SamplingParams(max_tokens=steps + WARMUP + 8, ignore_eos=True,
                                                          output_kind=output_kind, **params))
    engine.step()  # the prefill of every prompt (one step: the token budget holds them all)
    if engine.num_waiting:
        raise RuntimeError(f"{engine.num_waiting} requests still waiting after the prefill step")
    for _ in range(WARMUP):
        engine.step()
    clock = StageClock(engine)
    gpu = DeviceClock(engine) if device.startswith("cuda") else None
    times: list[float] = []
    cpu: list[float] = []
    stages: dict[str, list[float]] = {stage: [] for stage in (*STAGES, "host")}
    if gpu is not None:
        stages.update(gpu_busy=[], gpu_idle=[])
    for _ in range(steps):
        if profiler is not None:
            profiler.enable()
        t0, c0 = time.perf_counter(), time.thread_time()
        engine.step()
        cpu.append(time.thread_time() - c0)
        times.append(time.perf_counter() - t0)
        spent = clock.take()
        spent["host"] = cpu[-1] - spent["forward"]  # the step but the model's forward
        if gpu is not None:
            spent["gpu_busy"] = gpu.take()
            spent["gpu_idle"] = max(0.0, times[-1] - spent["gpu_busy"])
        for stage, seconds in spent.items():
            stages[stage].append(seconds)
        if profiler is not None:
            profiler.disable()
    if engine.num_running != running:
        raise RuntimeError(f"{engine.num_running} sequences running, expected {running}")
    engine.close()
    return times, cpu, {stage: statistics.median(v) for stage, v in stages.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--running", type=int, nargs="+", default=[256, 64])
    ap.add_argument("--vocabs", type=int, nargs="+", default=[320, 49152, 151936])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--profile", choices=list(MODES), help="cProfile this mode (256 running, first vocab)")
    ap.add_argument("--device", default="cpu",
                    help="cpu (the default) or cuda[:N]: the model in bfloat16 on the GPU; adds the "
                         "GPU's busy and idle time per step")
    ap.add_argument("--output-kind", choices=["cumulative", "final_only"], default="cumulative",
                    help="the requests' SamplingParams.output_kind (the worker daemon's: final_only)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for vocab in args.vocabs:
            model_dir = make_tiny_model(Path(tmp) / f"v{vocab}", vocab_size=vocab, **MODEL)
            if args.profile:
                prof = cProfile.Profile()
                time_case(model_dir, args.profile, args.running[0], args.steps, args.output_kind, prof,
                          args.device)
                pstats.Stats(prof).sort_stats("tottime").print_stats(30)
                return
            for running in args.running:
                for mode in args.modes:
                    wall, cpu, stages = time_case(model_dir, mode, running, args.steps, args.output_kind,
                                                  device=args.device)
                    med, med_cpu = statistics.median(wall), statistics.median(cpu)
                    name = f"{mode}/{running}/{vocab}"
                    results[name] = {"us_per_step": round(med * 1e6, 1),
                                     "us_per_seq_step": round(med * 1e6 / running, 2),
                                     "cpu_us_per_step": round(med_cpu * 1e6, 1),
                                     "stages_cpu_us": {k: round(v * 1e6, 1) for k, v in stages.items()}}
                    print(f"{name:24s} {med * 1e6:10.1f} us/step {med * 1e6 / running:8.2f} us/seq-step "
                          f"(cpu {med_cpu * 1e6:8.1f} us/step; "
                          + ", ".join(f"{k} {v * 1e6:.0f}" for k, v in stages.items()) + ")", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
