"""GGUF dequantization speed: batchinfer's torch dequantizers vs gguf's numpy reference.

Random block bytes (fp16 scale fields set to small finite values) of one ``rows x cols`` tensor
per type and shape. torch (into ``--dtype``) and numpy (into float32, the only dtype it has)
dequantize it in turn, ``--repeat`` rounds (more for small tensors), and each side's best time
counts. Each call returns a fresh tensor, as at load. torch runs on ``--threads`` threads
(numpy's code is single-threaded element-wise work). A shape whose rows do not hold whole
blocks of a type (576 columns of a K-quant) is skipped for it, as llama.cpp does.

    python bench/gguf_dequant.py     # Q4_1 Q8_0 Q6_K Q4_K; 4096x4096 49152x576 1536x576 576x1536
    python bench/gguf_dequant.py --threads 1 --dtype bfloat16
    python bench/gguf_dequant.py --types Q8_0 Q4_K --device cuda

On a shared, oversubscribed CPU run it with ``OMP_WAIT_POLICY=PASSIVE`` in the environment (or
``--threads 1``): spinning OpenMP threads waiting for a descheduled sibling make torch's
multi-threaded runs up to 40x slower there (docs/benchmarks.md).

The last line printed is one JSON object: per shape and type, torch and numpy elements/s and
their ratio (numpy time / torch time, both measured in this run).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as np_dequantize

from batchinfer.workers.models.gguf.dequant import dequantize_bytes

# Byte offsets of each block's fp16 fields (d, and dmin where there is one).
FP16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
               "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(qtype: GGMLQuantizationType, rows: int, cols: int) -> np.ndarray:
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    for off in FP16_FIELDS[qtype.name]:
        scales = rng.uniform(-0.05, 0.05, raw.shape[0]).astype(np.float16)
        raw[:, off:off + 2] = scales.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)  # one row of blocks per tensor row, as in a GGUF file


def race(fns: list, repeat: int) -> list[float]:
    """Best wall time of each function over ``repeat`` rounds, run in turn so both see the same load."""
    times = [float("inf")] * len(fns)
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            times[i] = min(times[i], time.perf_counter() - start)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--types", nargs="+", default=["Q4_1", "Q8_0", "Q6_K", "Q4_K"],
                    choices=sorted(FP16_FIELDS))
    ap.add_argument("--shapes", nargs="+", default=["4096x4096", "49152x576", "1536x576", "576x1536"],
                    help="ROWSxCOLS in torch order (SmolLM2: token_embd 49152x576, ffn_up 1536x576, "
                         "ffn_down 576x1536)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    results: dict[str, dict] = {}
    for shape in args.shapes:
        rows, cols = (int(x) for x in shape.split("x"))
        n = rows * cols
        for name in args.types:
            qtype = GGMLQuantizationType[name]
            if cols % GGML_QUANT_SIZES[qtype][0]:
                print(f"{name}: skipped for {shape} ({cols} columns are not whole blocks)")
                continue
            raw = random_blocks(qtype, rows, cols)
            on_device = torch.from_numpy(raw).to(args.device)  # GPU: time the arithmetic, not the copy

            def ours(on_device=on_device, qtype=qtype, rows=rows, cols=cols):
                dequantize_bytes(on_device, qtype, (rows, cols), dtype=dtype, device=args.device)
                sync()

            ours()  # warm-up
            rounds = max(args.repeat, 50_000_000 // n)  # small tensors: more rounds, less noise
            t_torch, t_numpy = race([ours, lambda raw=raw, qtype=qtype: np_dequantize(raw, qtype)], rounds)
            results.setdefault(shape, {})[name] = {
                "torch_elements_per_s": n / t_torch, "numpy_elements_per_s": n / t_numpy,
                "ratio": t_numpy / t_torch}
            print(f"{name}: torch {n / t_torch / 1e6:6.0f} M elements/s   numpy {n / t_numpy / 1e6:5.0f} M/s"
                  f"   x{t_numpy / t_torch:.1f}  ({shape}, {args.dtype}, {args.threads} threads, "
                  f"{args.device})")
    print(json.dumps({"threads": args.threads, "device": args.device, "dtype": args.dtype,
                      "shapes": results}))


if __name__ == "__main__":
    main()
