"""batchinfer vs llama.cpp side by side on the CPU: the same GGUF, token-id prompts and threads (issue 33).

llama.cpp runs in a subprocess, ``bench/llamacpp_runner.py`` under ``--llama-python`` (the bench
venv ``make bench-venv`` builds: llama-cpp-python 0.3.36 from source, so that it is compiled for
this CPU), scheduling as llama.cpp's server does with parallel slots (one ``llama_decode`` per step
for every sequence in flight). batchinfer runs here, ``LLM(model, dtype, quantization,
max_num_seqs=concurrency)``. Both sides: greedy, exactly ``--n-out`` tokens per request (EOS does
not stop), the same seeded prompts (token ids below 300, valid in any vocabulary, no BOS added),
``--threads`` threads; at concurrency C, C requests in flight (C = 1: one request at a time, on
``--c1-requests`` requests). Tokens/s = output tokens / wall time of the whole set (after a warm-up).

Models: ``demo`` (SmolLM2-135M-Instruct Q4_1, ``demo_gguf()``), ``tiny-f16`` / ``tiny-q8_0`` (a
random Llama of bench/engine_cpu.py's shape, ~20M parameters, written as GGUF on the fly with the
tests' writer), or a path to any .gguf file.

    .venv/bin/python -P bench/peer_llamacpp.py                       # demo, C 1/8/64, 1 thread
    .venv/bin/python -P bench/peer_llamacpp.py --model demo --model tiny-q8_0 --threads 1,2
    .venv/bin/python -P bench/peer_llamacpp.py --quick               # a smoke run (a minute)

Per (model, concurrency, threads) it prints both tokens/s, the ratio batchinfer / llama.cpp and
the first-tokens agreement (the fraction of requests whose first 8 output tokens are the same on
both sides: greedy on near-tied logits parts on numerics alone, more so in bfloat16), then what
ggml was built with (``llama_print_system_info``: AMX_INT8 = 1 when its AMX matmuls run); the last
line is one JSON object with every row.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from batchinfer import LLM, SamplingParams
from batchinfer.workers.auto_dtype import cpu_flags
from batchinfer.workers.engine_config import EngineConfig
from batchinfer.workers.models.demo import demo_gguf

ROOT = Path(__file__).resolve().parents[1]
# bench/ (engine_cpu's model shape and prompts) and tests/ (the GGUF writer): put here, since
# `python -P` leaves the script's folder off sys.path
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "tests")]
from engine_cpu import MODEL, workload  # noqa: E402

RUNNER = ROOT / "bench" / "llamacpp_runner.py"
AGREE_TOKENS = 8
TINY = {"tiny-f16": "F16", "tiny-q8_0": "Q8_0"}


def model_path(name: str, tmp: Path) -> Path:
    """The GGUF file ``name`` stands for (a tiny one is written into ``tmp`` on first use)."""
    if name == "demo":
        return demo_gguf()
    if name in TINY:
        dest = tmp / f"{name}.gguf"
        if not dest.exists():
            from gguf import GGMLQuantizationType
            from gguf_writer import write_gguf

            from batchinfer.workers.models.tiny import make_tiny_model

            hf = tmp / "tiny-hf"
            if not hf.exists():
                make_tiny_model(hf, **MODEL)
            write_gguf(hf, dest, getattr(GGMLQuantizationType, TINY[name]))
        return dest
    path = Path(name)
    if path.suffix != ".gguf" or not path.is_file():
        raise SystemExit(f"--model {name!r}: give demo, {', '.join(TINY)} or a .gguf file")
    return path


def llama_side(python: str, model: Path, prompts: list[list[int]], n_out: int, threads: int,
               concurrency: int, n_batch: int, kv_unified: bool) -> dict:
    """Run ``bench/llamacpp_runner.py`` in ``python``; its JSON, or ``{"error": ...}``."""
    job = {"model": str(model), "prompts": prompts, "n_out": n_out, "threads": threads,
           "concurrency": concurrency, "n_batch": n_batch, "kv_unified": kv_unified}
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run([python, str(RUNNER)], input=json.dumps(job), capture_output=True, text=True,
                          env=env, timeout=3600)
    if proc.returncode != 0:
        hint = ""
        if proc.returncode == -11 and "amx_int8" in cpu_flags():
            hint = (" (a crash on a CPU with AMX: llama.cpp built for it runs ggml's AMX matmul, which died "
                    "on such a VM before, docs/benchmarks.md; `make bench-venv` builds it without AMX)")
        return {"error": f"exit {proc.returncode}{hint}: {proc.stderr.strip()[-600:]}"}
    return json.loads(proc.stdout)


def our_engine_options(dtype: str, quantization: str | None, notes: list[str]) -> dict:
    """``LLM`` keyword arguments for ``--dtype`` / ``--quantization`` (the latter only where
    EngineConfig has the field: it is being added beside this bench)."""
    options: dict = {"dtype": dtype}
    if quantization is not None:
        if "quantization" in {f.name for f in dataclasses.fields(EngineConfig)}:
            options["quantization"] = quantization
        else:
            notes.append(f"--quantization {quantization}: this EngineConfig has no quantization field; "
                         "GGUF weights were dequantized into the dtype")
    return options


def our_side(llm: LLM, prompts: list[list[int]], n_out: int, threads: int, concurrency: int) -> dict:
    """batchinfer's outputs, wall time and tokens/s (concurrency 1: one request at a time)."""
    torch.set_num_threads(threads)
    params = SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], SamplingParams(max_tokens=4, ignore_eos=True),
                 use_tqdm=False)  # warm-up
    inputs = [{"prompt_token_ids": p} for p in prompts]
    t0 = time.perf_counter()
    if concurrency == 1:
        outs = [o for p in inputs for o in llm.generate([p], params, use_tqdm=False)]
    else:
        outs = llm.generate(inputs, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    outputs = [list(o.outputs[0].token_ids) for o in outs]
    return {"outputs": outputs, "wall_s": wall, "tokens_per_s": sum(map(len, outputs)) / wall}


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of requests whose first ``AGREE_TOKENS`` tokens are the same on both sides."""
    return sum(x[:AGREE_TOKENS] == y[:AGREE_TOKENS] for x, y in zip(a, b, strict=True)) / len(a)


def report(row: dict, ours: dict, theirs: dict) -> dict:
    """``row`` with both sides' figures, printed as one table line."""
    row["batchinfer_tokens_per_s"] = ours["tokens_per_s"]
    head = f"{row['model']:10} {row['concurrency']:>3} {row['threads']:>2} {row['requests']:>4} " \
           f"{ours['tokens_per_s']:>16.1f}"
    if "error" in theirs:
        row["llamacpp_error"] = theirs["error"]
        print(f"{head}  llama.cpp failed: {theirs['error']}", flush=True)
        return row
    row.update(llamacpp_tokens_per_s=theirs["tokens_per_s"],
               ratio=ours["tokens_per_s"] / theirs["tokens_per_s"],
               agree_first8=agreement(ours["outputs"], theirs["outputs"]), llamacpp_steps=theirs["steps"])
    print(f"{head} {theirs['tokens_per_s']:>15.1f} {row['ratio']:>6.2f} {row['agree_first8']:>7.2f}  "
          f"{row['dtype']}", flush=True)
    return row


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", help="demo, tiny-f16, tiny-q8_0 or a .gguf (repeatable; "
                    "default demo)")
    ap.add_argument("--concurrency", type=_ints, default=[1, 8, 64], help="comma list (default 1,8,64)")
    ap.add_argument("--threads", type=_ints, default=[1], help="comma list of thread counts (default 1)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--c1-requests", type=int, default=4, help="requests at concurrency 1 (default 4)")
    ap.add_argument("--prompt-len", type=_ints, default=[32, 384], help="MIN,MAX prompt tokens (seeded)")
    ap.add_argument("--n-out", type=int, default=64, help="output tokens per request")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-batch", type=int, default=2048, help="tokens per step on both sides "
                    "(llama.cpp n_batch, ubatch 512; batchinfer max_num_batched_tokens)")
    ap.add_argument("--dtype", default="auto", help="batchinfer's dtype (default auto)")
    ap.add_argument("--quantization", default="auto", help="batchinfer's quantization (default auto)")
    ap.add_argument("--llama-python", default=str(ROOT / ".venv-bench" / "bin" / "python"),
                    help="the python with llama_cpp (default .venv-bench/bin/python: make bench-venv)")
    ap.add_argument("--llama-kv-unified", action="store_true", help="one KV buffer for all sequences")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: 16 requests (2 at C=1), prompts 16-128, 16 tokens out, C 1,8")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.c1_requests, args.prompt_len, args.n_out = 16, 2, [16, 128], 16
        args.concurrency = [c for c in args.concurrency if c <= 8]
    if not Path(args.llama_python).is_file():
        raise SystemExit(f"--llama-python {args.llama_python}: not found; build it with `make bench-venv`")
    lo, hi = args.prompt_len
    prompts = workload(args.requests, (lo, hi), (args.n_out, args.n_out), args.seed)[0]
    notes: list[str] = []
    options = our_engine_options(args.dtype, args.quantization, notes)
    rows = []
    builds: set[str] = set()  # llama_print_system_info of the runs
    print(f"{'model':10} {'C':>3} {'T':>2} {'reqs':>4} {'batchinfer tok/s':>16} {'llama.cpp tok/s':>15} "
          f"{'ratio':>6} {'agree@8':>7}  dtype")
    with tempfile.TemporaryDirectory(prefix="peer-llamacpp-") as tmp:
        for name in args.model or ["demo"]:
            path = model_path(name, Path(tmp))
            for c in args.concurrency:
                batch = prompts[:args.c1_requests] if c == 1 else prompts
                max_len = -(-(max(map(len, batch)) + args.n_out + 1) // 16) * 16
                llm = LLM(model=path, max_num_seqs=c, max_num_batched_tokens=args.n_batch,
                          max_model_len=max_len, **options)
                dtype = str(llm.engine.model.dtype).removeprefix("torch.")
                for t in args.threads:
                    ours = our_side(llm, batch, args.n_out, t, c)
                    theirs = llama_side(args.llama_python, path, batch, args.n_out, t, c, args.n_batch,
                                        args.llama_kv_unified)
                    if theirs.get("system_info"):
                        builds.add(theirs["system_info"])
                    rows.append(report({"model": name, "concurrency": c, "threads": t, "requests": len(batch),
                                        "n_out": args.n_out, "dtype": dtype}, ours, theirs))
                del llm
    for info in sorted(builds):  # what ggml was built with (AMX_INT8 = 1: its AMX matmuls run)
        print("llama.cpp:", info)
    for note in notes:
        print("note:", note)
    print(json.dumps({"rows": rows, "dtype": args.dtype, "quantization": options.get("quantization"),
                      "prompt_len": [lo, hi], "n_batch": args.n_batch, "notes": notes,
                      "llamacpp_system_info": sorted(builds)}))


if __name__ == "__main__":
    main()
