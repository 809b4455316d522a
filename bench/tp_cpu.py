"""Tensor parallelism on the CPU: TP=2 (two gloo processes) against TP=1 on the same workload, and
what handing a step's inputs to the ranks costs.

    .venv/bin/python -P bench/tp_cpu.py              # 48 prompts of 64 tokens, 32 generated each
    .venv/bin/python -P bench/tp_cpu.py --quick      # 16 prompts
    python bench/tp_cpu.py --device cuda --quick      # bench/gpu_check.sh: TP=N over the GPUs (NCCL)

Part 1, the engine: one random Llama-shaped checkpoint (hidden 512, 4 layers, 8 heads, 4 KV heads,
float32), the same greedy requests through ``Engine`` at TP=1 and at TP=2, one run each (a
correctness-and-overhead figure: two cores cannot make TP faster, every rank already has one
core's worth of matmuls and the all-reduces come on top). TP=1 runs twice: with one thread (what
each rank has) and with every core (intra-op threads; on a machine busy with other work OpenMP's
spinning threads can make this one far slower, hence both). Reported: generated tokens/s of each,
whether the tokens agree, and the step-input cost as the engine meets it: rank 0's pack + signal
per step, and each rank's latency from that write to holding its copy (measured on the rank).

Part 2, the transport alone: rank 0 hands the same packed step (a decode step of 32 sequences,
a prefill step of 512 tokens) to an idle rank 1, by the engine's ``StepChannel`` (shared memory +
a semaphore) and by ``torch.distributed`` broadcasts (the step's size, then the payload, gloo): the
median latency from rank 0's send to rank 1 holding the arrays.

The last line is one JSON object. ``-P``: the repository's ``kernels/`` folder must not shadow the
package transformers probes.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from batchinfer.workers.engine.engine import Engine
from batchinfer.workers.engine.tp_ranks import free_port
from batchinfer.workers.engine_config import EngineConfig
from batchinfer.workers.models.tiny import make_tiny_model
from batchinfer.workers.parallel.step_inputs import StepChannel
from batchinfer.workers.sampling_params import SamplingParams

MODEL = {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 4, "max_position_embeddings": 1024}


def run_engine(path: Path, tp: int, device: str, prompts: list[list[int]], max_tokens: int,
               threads: int = 1) -> dict[str, Any]:
    """One engine at ``tp`` ranks over ``prompts``: tokens/s, the tokens, step-input costs.
    ``threads``: TP=1's intra-op threads on the CPU (a TP engine gives each rank cores / N)."""
    if device == "cpu":
        torch.set_num_threads(threads)
    if tp > 1 and device == "cuda":
        device = ",".join(f"cuda:{i}" for i in range(tp))
    engine = Engine(EngineConfig(model=str(path), tensor_parallel_size=tp, device=device, max_num_seqs=64,
                                 max_num_batched_tokens=1024, num_kv_blocks=512))
    send_ns: list[int] = []
    if engine.ranks is not None:
        channel = engine.ranks.channel
        send = channel.send

        def timed_send(*args: Any) -> None:
            began = time.perf_counter_ns()
            send(*args)
            send_ns.append(time.perf_counter_ns() - began)

        channel.send = timed_send  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.add_request("warm", prompt_token_ids=prompts[0], sampling_params=warm)
    while engine.has_unfinished():
        engine.step()
    steps_before = engine.num_steps
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", prompt_token_ids=p, sampling_params=params)
    tokens: dict[str, list[int]] = {}
    began = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
    seconds = time.perf_counter() - began
    steps = engine.num_steps - steps_before
    engine.close()
    result: dict[str, Any] = {"tp": tp, "seconds": round(seconds, 3), "steps": steps,
                              "tokens_per_s": round(len(prompts) * max_tokens / seconds, 1),
                              "ms_per_step": round(1e3 * seconds / steps, 2)}
    if engine.ranks is not None:
        result["send_us_mean"] = round(statistics.fmean(send_ns) / 1e3, 1)
        result["rank_latency_us"] = {r: {k: round(v, 1) for k, v in s.items()}
                                     for r, s in engine.ranks.step_input_latency().items()}
    return {**result, "tokens": tokens}


def step_arrays(S: int, T: int, M: int) -> dict[str, np.ndarray]:
    """Host arrays of a step of ``S`` sequences, ``T`` tokens, ``M`` blocks each (values arbitrary)."""
    rng = np.random.default_rng(0)
    return {"input_ids": rng.integers(0, 320, T), "positions": np.arange(T, dtype=np.int64),
            "slot_mapping": np.arange(T, dtype=np.int64),
            "block_tables": rng.integers(0, 512, (S, M)).astype(np.int32),
            "cu_seqlens_q": np.linspace(0, T, S + 1).astype(np.int32),
            "seq_lens": np.full(S, M * 16, np.int32), "sample_indices": np.arange(S, dtype=np.int64)}


SHAPES = {"decode": (32, 32, 8), "prefill": (4, 512, 32)}  # (S, T, M)


def _transport_rank1(port: int, channel: StepChannel, conn: Any, rounds: int) -> None:
    """Rank 1 of part 2: receive ``rounds`` steps per shape by each transport; report latencies."""
    from batchinfer.workers.parallel.group import TPGroup

    torch.set_num_threads(1)
    tp = TPGroup.init(1, 2, f"tcp://127.0.0.1:{port}", "gloo", "cpu", timeout_s=60)
    out: dict[str, list[int]] = {}
    for shape in SHAPES:
        out[f"shm_{shape}"] = [channel.receive(1).latency_ns for _ in range(rounds)]
        lat = []
        for _ in range(rounds):
            header = torch.zeros(2, dtype=torch.int64)
            tp.broadcast(header)  # [payload length, sent at]
            payload = torch.empty(int(header[0]), dtype=torch.int64)
            tp.broadcast(payload)
            lat.append(time.monotonic_ns() - int(header[1]))
        out[f"gloo_{shape}"] = lat
    conn.send(out)
    tp.close()


def transport(rounds: int) -> dict[str, float]:
    """Part 2: median microseconds from rank 0's send to an idle rank 1 holding the step."""
    from batchinfer.workers.parallel.group import TPGroup

    ctx = mp.get_context("spawn")
    port = free_port()
    channel = StepChannel(ctx, 2, max_tokens=1024, max_seqs=64, max_blocks_per_seq=64)
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_transport_rank1, args=(port, channel, child, rounds))
    proc.start()
    tp = TPGroup.init(0, 2, f"tcp://127.0.0.1:{port}", "gloo", "cpu", timeout_s=60)
    for S, T, M in SHAPES.values():
        host = step_arrays(S, T, M)
        for _ in range(rounds):
            time.sleep(0.002)  # rank 1 is idle, waiting, as between two engine steps
            channel.send(host, T, M * 16)
        packed = np.concatenate([host[k].reshape(-1).astype(np.int64) for k in host])
        for _ in range(rounds):
            time.sleep(0.002)
            tp.broadcast(torch.tensor([packed.size, time.monotonic_ns()], dtype=torch.int64))
            tp.broadcast(torch.from_numpy(packed))
    lat = parent.recv()
    proc.join(timeout=30)
    tp.close()
    return {k: round(statistics.median(v[rounds // 10:]) / 1e3, 1) for k, v in lat.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="16 prompts instead of 48")
    ap.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL, one GPU per rank)")
    ap.add_argument("--tp", type=int, default=2, help="ranks of the parallel run [2]")
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    n = 16 if args.quick else 48
    rng = np.random.default_rng(0)
    prompts = [rng.integers(5, 300, 64).tolist() for _ in range(n)]
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_model(Path(tmp) / "tp-bench", **MODEL)
        one_device = "cuda:0" if args.device == "cuda" else "cpu"
        one = run_engine(path, 1, one_device, prompts, args.max_tokens, threads=1)
        many = run_engine(path, args.tp, args.device, prompts, args.max_tokens)
        cores = os.cpu_count() or 1
        all_cores = run_engine(path, 1, one_device, prompts, args.max_tokens, threads=cores) \
            if args.device == "cpu" and cores > 1 else None
    tokens = one.pop("tokens")
    equal = tokens == many.pop("tokens")
    result: dict[str, Any] = {"device": args.device, "prompts": n, "prompt_tokens": 64,
                              "max_tokens": args.max_tokens, "load_average": os.getloadavg()[0],
                              "tp1": one, f"tp{args.tp}": many, "tokens_equal": equal,
                              "tp_over_tp1": round(many["tokens_per_s"] / one["tokens_per_s"], 3)}
    print(f"TP=1 (1 thread): {one['tokens_per_s']} tok/s ({one['ms_per_step']} ms/step); TP={args.tp}: "
          f"{many['tokens_per_s']} tok/s ({many['ms_per_step']} ms/step); tokens equal: {equal}")
    if all_cores is not None:
        result["tokens_equal"] = equal and all_cores.pop("tokens") == tokens
        result[f"tp1_{cores}_threads"] = all_cores
        print(f"TP=1 ({cores} threads): {all_cores['tokens_per_s']} tok/s "
              f"({all_cores['ms_per_step']} ms/step)")
    print(f"step inputs in the engine: rank 0 pack+signal {many['send_us_mean']} us/step; "
          f"rank latency {many['rank_latency_us']}")
    if args.device == "cpu":
        result["transport_us_median"] = transport(200 if not args.quick else 50)
        print(f"transport alone (median us, idle rank): {result['transport_us_median']}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
