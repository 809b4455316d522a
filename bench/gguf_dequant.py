"""GGUF dequantization speed: batchinfer's torch dequantizers vs gguf's numpy reference.

Random block bytes (fp16 scale fields set to small finite values) of one ``rows x cols`` tensor
per type; each side dequantizes it ``--repeat`` times to float32 and the best time counts.
torch runs on ``--threads`` threads (numpy's code is single-threaded element-wise work).

    python bench/gguf_dequant.py                 # Q4_1 and Q6_K, 4096 x 4096, 2 threads
    python bench/gguf_dequant.py --types Q8_0 Q4_K --device cuda

The last line printed is one JSON object: per type, torch and numpy elements/s and their ratio.
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
    return raw.reshape(rows, -1)


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--types", nargs="+", default=["Q4_1", "Q6_K"], choices=sorted(FP16_FIELDS))
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n = args.rows * args.cols
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    results = {}
    for name in args.types:
        qtype = GGMLQuantizationType[name]
        raw = random_blocks(qtype, args.rows, args.cols)
        on_device = torch.from_numpy(raw).to(args.device)  # GPU: time the arithmetic, not the copy

        def ours(on_device=on_device, qtype=qtype):
            dequantize_bytes(on_device, qtype, (args.rows, args.cols), device=args.device)
            sync()

        ours()  # warm-up
        t_torch = best(ours, args.repeat)
        t_numpy = best(lambda raw=raw, qtype=qtype: np_dequantize(raw, qtype), args.repeat)
        results[name] = {"torch_elements_per_s": n / t_torch, "numpy_elements_per_s": n / t_numpy,
                         "ratio": t_numpy / t_torch}
        print(f"{name}: torch {n / t_torch / 1e6:8.0f} M elements/s   numpy {n / t_numpy / 1e6:6.0f} M/s   "
              f"x{t_numpy / t_torch:.1f}  ({args.rows}x{args.cols}, {args.threads} threads, {args.device})")
    print(json.dumps({"threads": args.threads, "device": args.device, "shape": [args.rows, args.cols],
                      "types": results}))


if __name__ == "__main__":
    main()
