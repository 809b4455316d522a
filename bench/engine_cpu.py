"""CPU benchmark of the engine: batchinfer's ``LLM`` vs transformers ``generate``, in one run.

The same tiny random Llama (~20M parameters, float32) and workload for both: 256 requests with
prompts of 32-512 tokens and 32-256 output tokens each, greedy, ``ignore_eos``. transformers runs
them in padded static batches of 32 (arrival order, left padding, each batch generating until its
longest request is done); only the tokens each request asked for are counted.

Engine efficiency = engine tokens/s / tokens/s of bare model forwards at the same tokens per step:
every 4th step is replayed through ``Decoder.forward`` + ``compute_logits`` alone (same inputs),
and efficiency is bare time / engine step time over those steps, i.e. the share of the step loop
spent running the model rather than scheduling, building inputs, sampling and detokenising.

Roofline efficiency = the sum over the replayed steps of each step's ceiling time ÷ the engine's
time on them, where a step's ceiling = max(FLOPs ÷ matmul rate, bytes ÷ copy bandwidth). FLOPs are
counted from the step's inputs: 2 x tokens x (every layer's projection and MLP weights), 2 x sampled
rows x the LM head, and attention's QK and PV (4 x heads x head_dim per query-key pair, over the
keys each causal query sees). The matmul rate is the step's own: its replay through ``F.linear`` of
a [T, in] input with each of the model's weights (all layers, then the LM head at the step's sampled
rows), so it sees the same token counts, thread count and machine load as the engine. Bytes = every
weight once per step (the LM head when the step samples) + the K/V the step's attention reads (each
sequence's context, once per layer); the copy bandwidth is the read + write traffic of a large
``copy_`` timed before and after the runs. Beside it, the per-op ceiling: the decode rows'
attention (their K/V read at ~1 FLOP a byte) timed at the copy bandwidth after the step's other
work, max(FLOPs / matmul rate, bytes / bandwidth) of the rest, as one thread runs the two in turn.

The engine runs twice, with the compiled CPU decode kernel (``BATCHINFER_CPU_DECODE_KERNEL=1``) and
without it (``0``): tokens/s and the roofline of each (``--decode-kernel on|off``: one of them).
``--attention`` runs only a micro-bench of decode attention alone (kernel vs the torch gather path,
per-head vs per-sequence work items, our cache layout vs vLLM's) at the model's head shapes.
``--linear`` runs only micro-benches of the model's linear layers at 1-8 rows (a decode step of 1-8
sequences): torch's ``F.linear`` against the extension's GEMV (``kernels/cpu_ext/gemv``), the ratio
of the two and each one's weight bytes read per second, the copy bandwidth measured in the same run
printed beside them; first each shape alone in bfloat16 (a small layer's weights stay in cache
between calls), then all of the model's weights streamed one after the other, as a decode step
reads them, in float32, bfloat16 and float16, and as int8 codes (torch's packed kernel against the int8 GEMV).
``--elementwise`` runs only SiLU-and-mul at the model's intermediate size: torch's two ops against
the extension's one (``kernels/cpu_ext/fused_ops.cpp``) at 1-2,048 rows, and their ratio.
``--block-size`` sets the engine's (and ``--attention``'s) tokens per KV block.

On a machine shared with other work, ``--threads 1`` gives steadier figures: OpenMP threads that
wait at barriers for a descheduled sibling make multi-threaded timings swing by 10x.

    python bench/engine_cpu.py            # the full run (minutes)
    python bench/engine_cpu.py --quick    # a small smoke version
    python bench/engine_cpu.py --model demo               # SmolLM2-135M-Instruct (its GGUF file)
    python bench/engine_cpu.py --model PATH               # any HF folder or .gguf file
    python bench/engine_cpu.py --model demo --workload small --threads 2 --no-transformers
    python bench/engine_cpu.py --workload small --profile   # + torch profiler table by op
    python bench/engine_cpu.py --workload small --threads 1 --cpu-clock --no-transformers
    python bench/engine_cpu.py --attention --threads 1 --cpu-clock   # decode attention alone
    python bench/engine_cpu.py --linear --model demo --threads 1     # few-row matmuls alone
    python bench/engine_cpu.py --elementwise --threads 1 --cpu-clock # SiLU-and-mul alone

With ``--model``, both sides load that checkpoint in float32 (transformers a GGUF file through
``from_pretrained(folder, gguf_file=...)``, which dequantizes it); the workload stays token ids
below 300, valid in any vocabulary.

``--cpu-clock`` (with ``--threads 1``) times with the main thread's CPU time instead of wall time.

The last line printed is one JSON object: tokens_per_s, transformers_tokens_per_s, ratio, efficiency
(engine), model_gflops_per_s, matmul_gflops_per_s, copy_gb_per_s, roofline_efficiency,
serial_roofline_efficiency (the per-op ceiling's), decode_kernel
(on / off: the run those figures are of), tokens_per_s_kernel_off and roofline_efficiency_kernel_off
(with both runs). The transformers figures are null with ``--no-transformers``; the efficiencies and
the matmul rate with ``--profile``, which replays nothing. ``--profile`` also prints where every 4th
step's time went, by op category. With ``--attention``: {"attention": [one object per case]}.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from batchinfer import LLM, SamplingParams
from batchinfer.workers.models.demo import demo_gguf
from batchinfer.workers.models.tiny import make_tiny_model

MODEL = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 6, "num_attention_heads": 8,
         "num_key_value_heads": 4, "max_position_embeddings": 1024}
FULL = {"requests": 256, "prompt": (32, 512), "output": (32, 256), "hf_batch": 32}
QUICK = {"requests": 32, "prompt": (16, 128), "output": (8, 48), "hf_batch": 8}
SMALL = {"requests": 64, "prompt": (32, 384), "output": (64, 64), "hf_batch": 32}  # issue 16's workload
WORKLOADS = {"full": FULL, "quick": QUICK, "small": SMALL}


def clock() -> float:
    """The benchmark's clock: wall time, or with ``--cpu-clock`` the main thread's CPU time (steady on a
    shared machine with one torch thread; it leaves out time spent waiting for a core)."""
    return time.thread_time() if CPU_CLOCK else time.perf_counter()


CPU_CLOCK = False  # set by --cpu-clock


def workload(n: int, prompt: tuple[int, int], output: tuple[int, int], seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(0, 300) for _ in range(rng.randint(*prompt))] for _ in range(n)]
    outputs = [rng.randint(*output) for _ in range(n)]
    return prompts, outputs


class ReplayedStep(NamedTuple):
    """One replayed step's roofline terms."""

    flops: float  # every FLOP of the step
    nbytes: float  # its weights and K/V bytes
    rate: float  # matmul FLOP/s at its shapes (the replay)
    engine_s: float  # the engine's seconds on it
    decode_flops: float  # of the FLOPs, the decode rows' attention
    decode_bytes: float  # of the bytes, the K/V those rows read


class FlopModel:
    """FLOPs and bytes of the steps of a dense decoder, and a timed roofline of them.

    Every ``nn.Linear`` of a layer counts for every token, so a mixture-of-experts model is
    over-counted (all experts); elementwise ops (norms, rotary, SiLU, softmax) count nothing.
    Bytes of a step: every weight read once (the LM head only when the step samples) plus the K/V
    its attention reads (each sequence's whole context, once per layer)."""

    def __init__(self, model: nn.Module, max_tokens: int, cache_dtype: torch.dtype):
        cfg = model.config
        self.layer_weights = [m.weight for layer in model.layers for m in layer.modules()
                              if isinstance(m, nn.Linear)]  # qkv, o, gate_up, down of every layer
        self.layer_macs = sum(w.numel() for w in self.layer_weights)  # per token
        self.layer_bytes = sum(w.numel() * w.element_size() for w in self.layer_weights)
        self.head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight  # [V, C]
        self.head_bytes = self.head.numel() * self.head.element_size()
        self.attn_macs = 2 * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers  # QK + PV, a pair
        # K + V bytes of one cached token over all layers: what attention reads per key.
        self.kv_bytes = model.kv_cache_bytes_per_token(cache_dtype)
        self.decode_kv_bytes = 0.0  # read by decode rows (one query: memory-bound, no reuse)
        widths = {w.shape[1] for w in self.layer_weights} | {self.head.shape[1]}
        gen = torch.Generator().manual_seed(0)
        self.inputs = {n: torch.randn(max_tokens, n, generator=gen) for n in widths}  # [T, in] per width
        self.flops = {"linear": 0.0, "lm_head": 0.0, "attention": 0.0}
        self.bytes = 0.0
        self.ceiling_flops = 0.0
        self.ceiling_time = 0.0
        self.replayed: list[ReplayedStep] = []

    def step_cost(self, inputs) -> tuple[dict[str, float], float, float, float]:
        """The step's FLOPs by kind, its bytes, the K/V bytes its decode rows read and those rows'
        attention FLOPs."""
        meta = inputs.attn_metadata
        cu, lens = meta.cu_seqlens_q.tolist(), meta.seq_lens.tolist()
        T, N = cu[-1], inputs.sample_indices.numel()
        pairs = 0  # (query, visible key) pairs: a chunk's q queries end at position L - 1
        keys = decode_keys = 0  # cached keys attention reads (per layer); a decode row's pairs = its keys
        for i, length in enumerate(lens):
            q = cu[i + 1] - cu[i]
            pairs += q * (length - q + 1) + q * (q - 1) // 2
            keys += length if q else 0
            decode_keys += length if q == 1 else 0
        flops = {"linear": 2.0 * T * self.layer_macs, "lm_head": 2.0 * N * self.head.numel(),
                 "attention": 2.0 * pairs * self.attn_macs}
        nbytes = self.layer_bytes + (self.head_bytes if N else 0) + keys * self.kv_bytes
        return flops, nbytes, decode_keys * self.kv_bytes, 2.0 * decode_keys * self.attn_macs

    def count(self, inputs) -> None:
        """Add the step's FLOPs and bytes (from its ``StepInputs``)."""
        flops, nbytes, decode_bytes, _ = self.step_cost(inputs)
        for kind, value in flops.items():
            self.flops[kind] += value
        self.bytes += nbytes
        self.decode_kv_bytes += decode_bytes

    def time_ceiling(self, inputs) -> float:
        """Time ``F.linear`` of the step's [T, in] inputs with every weight; returns the seconds."""
        T, N = inputs.input_ids.numel(), inputs.sample_indices.numel()
        t0 = clock()
        with torch.inference_mode():
            for w in self.layer_weights:
                F.linear(self.inputs[w.shape[1]][:T], w)
            if N:
                F.linear(self.inputs[self.head.shape[1]][:N], self.head)
        elapsed = clock() - t0
        self.ceiling_flops += 2.0 * (T * self.layer_macs + N * self.head.numel())
        self.ceiling_time += elapsed
        return elapsed

    def replay(self, inputs, engine_seconds: float) -> float:
        """Time the step's matmuls (``time_ceiling``) and keep its roofline terms; returns the seconds."""
        matmul_flops = self.ceiling_flops
        elapsed = self.time_ceiling(inputs)
        rate = (self.ceiling_flops - matmul_flops) / elapsed
        flops, nbytes, decode_bytes, decode_flops = self.step_cost(inputs)
        self.replayed.append(ReplayedStep(sum(flops.values()), nbytes, rate, engine_seconds, decode_flops,
                                          decode_bytes))
        return elapsed

    def roofline(self, bandwidth: float) -> dict[str, float] | None:
        """Over the replayed steps: the ceiling time (per step max(FLOPs / its matmul rate, bytes /
        ``bandwidth``)), the engine's time on them, their ratio, and the share of memory-bound steps.

        Also the per-op ceiling (``serial_*``): the same terms, but the decode rows' attention, which
        reads its K/V at ~1 FLOP a byte, timed at ``bandwidth`` *after* the rest of the step, as one
        thread runs them (the matmuls, then attention, layer by layer): per step max(the other FLOPs
        / rate, the other bytes / bandwidth) + the decode rows' K/V bytes / bandwidth."""
        if not self.replayed:
            return None
        steps = self.replayed
        ceilings = [(r.flops / r.rate, r.nbytes / bandwidth) for r in steps]
        ceiling = sum(max(c) for c in ceilings)
        serial = sum(max((r.flops - r.decode_flops) / r.rate, (r.nbytes - r.decode_bytes) / bandwidth)
                     + r.decode_bytes / bandwidth for r in steps)
        engine = sum(r.engine_s for r in steps)
        return {"ceiling_s": ceiling, "engine_s": engine, "efficiency": ceiling / engine,
                "memory_bound_share": sum(m > c for c, m in ceilings) / len(ceilings),
                "serial_ceiling_s": serial, "serial_efficiency": serial / engine}


def copy_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Memory traffic of a large ``copy_`` (bytes read + written per second, best of ``repeats``) on
    torch's threads: the bandwidth term of the roofline."""
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch
    best = float("inf")
    for _ in range(repeats):
        t0 = clock()
        dst.copy_(src)
        best = min(best, clock() - t0)
    return 2 * nbytes / best


def run_engine(model_dir: Path, prompts, outputs, replay_every: int, profile: bool = False,
               block_size: int = 16) -> tuple[float, int, float | None, dict, FlopModel]:
    """Wall time and tokens of ``LLM.generate``, the engine efficiency, stats and the FLOP counts.

    Every ``replay_every``-th step is replayed through the bare model right after it ran (same
    inputs, same cache: it rewrites identical K/V), then through the plain-matmul ceiling, so all
    three timings see the same machine load; the replays are left out of the engine's wall time.
    ``replay_every`` 0: no replays (the efficiency is then None, the ceiling untimed).
    ``profile``: every 4th step runs under torch's profiler (its events summed per op after it,
    which bounds the memory) and where those steps' time went is printed; the figures then include
    the profiler's overhead.
    """
    max_tokens = 2048
    llm = LLM(model_dir, max_num_seqs=256, max_num_batched_tokens=max_tokens, block_size=block_size,
              num_kv_blocks=8192 * 16 // block_size)  # 131,072 cached tokens at any block size
    engine, runner = llm.engine, llm.engine.runner
    flops = FlopModel(runner.model, max_tokens, runner.kv_caches[0][0].dtype)
    # Warm up (first-call allocations) with a small request.
    llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4), use_tqdm=False)

    prepare, step = runner.prepare, engine.step
    timing = {"steps": 0, "bare": 0.0, "engine": 0.0, "replays": 0.0}
    ops: dict[str, list[float]] = {}  # profiled op -> [self seconds, total seconds, calls]
    profiler = None
    recorded = []
    stepped = []  # the step's inputs, counted after its timing

    def recording_prepare(scheduled, order=None):
        inputs = prepare(scheduled, order)
        stepped.append(inputs)
        if replay_every and timing["steps"] % replay_every == 0:
            recorded.append(inputs)
        return inputs

    def timed_step():
        t0 = clock()
        out = step()
        elapsed = clock() - t0
        timing["steps"] += 1
        for inputs in stepped:
            flops.count(inputs)
        stepped.clear()
        if profiler is not None:  # the step's events are summed now, outside the timed span
            t0 = clock()
            profiler.step()
            timing["replays"] += clock() - t0
        if recorded:
            inputs = recorded.pop()
            t0 = clock()
            with torch.inference_mode():
                hidden = runner.model(inputs.input_ids, inputs.positions, runner.kv_caches,
                                      inputs.attn_metadata)
                runner.model.compute_logits(hidden[inputs.sample_indices])
            bare = clock() - t0
            timing["bare"] += bare
            timing["engine"] += elapsed
            timing["replays"] += bare + flops.replay(inputs, elapsed)
        return out

    runner.prepare, engine.step = recording_prepare, timed_step
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in outputs]
    requests = [{"prompt_token_ids": p} for p in prompts]
    if profile:
        # Every 4th step profiled, each summed into ``ops`` and dropped: one profile of a whole run
        # (30 layers) outgrew 20 GiB, and summing a step's events takes seconds. No record_shapes:
        # the LM head is labelled instead.
        def add_events(prof) -> None:
            for e in prof.key_averages():
                row = ops.setdefault(e.key, [0.0, 0.0, 0])
                row[0] += e.self_cpu_time_total / 1e6
                row[1] += e.cpu_time_total / 1e6
                row[2] += e.count

        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                          schedule=torch.profiler.schedule(wait=3, warmup=0, active=1),
                                          on_trace_ready=add_events)
        profiler.__enter__()
        compute_logits = runner.model.compute_logits

        def labelled_logits(hidden):
            with torch.profiler.record_function("lm_head"):
                return compute_logits(hidden)

        runner.model.compute_logits = labelled_logits
    t0 = clock()
    outs = llm.generate(requests, params, use_tqdm=False)
    span = clock() - t0
    wall = span - timing["replays"]
    if profiler is not None:
        profiler.__exit__(None, None, None)
        del runner.model.compute_logits  # back to the class's method
        print_profile(ops)
    runner.prepare, engine.step = prepare, step
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == sum(outputs)
    stats = {"steps": timing["steps"], "preemptions": engine.num_preemptions,
             "tokens_per_step": engine.num_computed_tokens / max(1, engine.num_steps)}
    return wall, tokens, timing["bare"] / timing["engine"] if timing["engine"] else None, stats, flops


# Op names -> where the time goes (self CPU time; linear ops are split by the weight's shape).
CATEGORIES = {
    "attention: paged-cache gather (index_select)": ("aten::index_select",),
    "attention: scores / softmax / PV": ("aten::bmm", "aten::_softmax", "aten::masked_fill_",
                                         "aten::_scaled_dot_product_flash_attention_for_cpu"),
    "RMSNorm / rotary / SiLU / residual (elementwise)": (
        "aten::silu", "aten::mul", "aten::mul_", "aten::pow", "aten::mean", "aten::rsqrt", "aten::add",
        "aten::add_", "aten::neg", "aten::cat", "aten::sub", "aten::sub_", "aten::index", "aten::to",
        "aten::_to_copy", "aten::copy_"),
    "KV write (index_put_)": ("aten::_index_put_impl_", "aten::index_put_"),
}


def cfg_intensity(model: nn.Module) -> float:
    """Decode attention's FLOPs per byte of K/V read: 4 H D FLOPs per key over 8 KVH D bytes."""
    return model.config.num_attention_heads / (2 * model.num_kv_heads)


def print_profile(ops: dict[str, list[float]]) -> None:
    """Where the profiled steps' time went: self time by category (the LM head is the time under
    the ``lm_head`` label, taken out of the linear ops), the untraced rest (Python), then the top ops.

    ``ops``: op name -> [self s, total s, calls]. An op's self time is its duration on the calling
    thread (OpenMP workers run inside it); the ``ProfilerStep*`` spans (engine step to engine step)
    hold them all, and their own self time is the untraced Python."""
    spent: dict[str, float] = {}
    wall = ops.get("ProfilerStep*", [0.0, 0.0, 0])[1]
    lm_head = ops.get("lm_head", [0.0, 0.0, 0])[1]
    for name, (self_s, _, _) in ops.items():
        if name == "lm_head" or name.startswith("ProfilerStep"):
            continue
        linear = name in ("aten::mm", "aten::addmm")
        cat = "linear" if linear else next((c for c, names in CATEGORIES.items() if name in names),
                                           "other ops")
        if name.startswith("batchinfer_cpu_decode"):  # the compiled library's ops: <namespace>::<op>
            cat = ("RMSNorm / rotary / SiLU / residual (elementwise)"
                   if name.rpartition("::")[2] in ("rms_norm", "rotary_cache", "silu_and_mul")
                   # decode_layers' self time: the decode kernel and the fused ops it calls directly
                   else "attention: compiled decode kernel + layer loop (kernels/cpu_ext)")
        spent[cat] = spent.get(cat, 0.0) + self_s
    spent["LM head (linear, under the lm_head label)"] = lm_head
    spent["projections + MLP (linear)"] = spent.pop("linear", 0.0) - lm_head
    spent["untraced (Python: scheduler, inputs, sampler, outputs)"] = ops.get("ProfilerStep*", [0.0])[0]
    total = sum(spent.values())
    print(f"profile: {wall:.1f} s wall, {torch.get_num_threads()} threads; self time by category:")
    for cat, sec in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"  {cat:56s} {sec:8.2f} s  {sec / total:6.1%}")
    print("top ops by self time:")
    for name, (self_s, total_s, calls) in sorted(ops.items(), key=lambda kv: -kv[1][0])[:20]:
        print(f"  {name:56s} {self_s:8.2f} s self {total_s:8.2f} s total {int(calls):8d} calls")


def load_transformers(model: Path):
    import transformers

    if model.suffix.lower() == ".gguf":
        return transformers.AutoModelForCausalLM.from_pretrained(model.parent, gguf_file=model.name,
                                                                 dtype=torch.float32).eval()
    return transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()


def run_transformers(model_dir: Path, prompts, outputs, batch: int) -> tuple[float, int]:
    hf = load_transformers(model_dir)
    tokens = 0
    t0 = clock()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            group, wants = prompts[i:i + batch], outputs[i:i + batch]
            width = max(len(p) for p in group)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in group])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=max(wants), do_sample=False,
                              eos_token_id=None, pad_token_id=0)
            assert out.shape[1] == width + max(wants)
            tokens += sum(wants)  # the padding-generated extra tokens do not count
    return clock() - t0, tokens


def _timed(fn, min_seconds: float = 0.05, repeats: int = 5) -> float:
    """Seconds per call of ``fn``: the best of ``repeats`` rounds of enough calls to last
    ``min_seconds`` (on ``clock``)."""
    fn()
    t0 = clock()
    fn()
    calls = max(1, int(min_seconds / max(clock() - t0, 1e-6)))
    best = float("inf")
    for _ in range(repeats):
        t0 = clock()
        for _ in range(calls):
            fn()
        best = min(best, (clock() - t0) / calls)
    return best


def attention_micro(num_heads: int, num_kv_heads: int, head_dim: int, quick: bool,
                    ragged: bool = False, block_size: int = 16) -> list[dict]:
    """Decode attention alone: the compiled kernel (its default work items: whole sequences from 4
    decode rows a thread) against the torch gather path and against per-(sequence, KV head) items
    (each pass reads one KV head's rows of a block), and the kernel reading our cache
    layout ``[blocks, block_size, KVH, D]`` against a copy of the cache in vLLM's CPU layout
    ``[blocks, KVH, block_size, D]`` (the same kernel, through strides; the better work items of
    each). B sequences of L tokens each (``ragged``: of lengths drawn from [L/4, L], as an engine's
    batch holds) over shuffled blocks of ``block_size`` tokens; one query per sequence."""
    from batchinfer.kernels import cpu_attention
    from batchinfer.kernels.cpu_ext import decode

    if not decode.available():
        raise SystemExit(f"the CPU decode kernel is unavailable: {decode.unavailable_reason()}")
    batches, contexts = ((1, 64), (128, 1024)) if quick else ((1, 16, 64, 256), (128, 512, 2048))
    bs, rows = block_size, []
    print(f"decode attention alone: {num_heads} heads, {num_kv_heads} KV heads, head_dim {head_dim}, "
          f"block {bs}, {'ragged lengths in [L/4, L], ' if ragged else ''}{torch.get_num_threads()} threads; "
          "ms per call "
          f"({'thread CPU' if CPU_CLOCK else 'wall'} time, best of 5)")
    print(f"  {'cache':8s} {'B':>4s} {'L':>5s} {'K/V MB':>7s} {'gather':>8s} {'kernel':>8s} {'speedup':>7s} "
          f"{'GB/s':>6s} {'kernel/head':>11s} {'vLLM layout':>11s} {'vLLM/ours':>9s}")
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for B in batches:
            for L in contexts:
                nb = -(-L // bs)
                shape = (B * nb + 8, bs, num_kv_heads, head_dim)
                if 2 * B * L * num_kv_heads * head_dim * dtype.itemsize > (512 << 20):
                    continue
                lens = (torch.randint(max(1, L // 4), L + 1, (B,), generator=gen) if ragged
                        else torch.full((B,), L)).int()
                kv_bytes = 2 * int(lens.sum()) * num_kv_heads * head_dim * dtype.itemsize
                k = torch.randn(shape, generator=gen).to(dtype)
                v = torch.randn(shape, generator=gen).to(dtype)
                tables = torch.randperm(shape[0], generator=gen)[:B * nb].view(B, nb).int()
                q = torch.randn(B, num_heads, head_dim, generator=gen).to(dtype)
                cu = torch.arange(B + 1, dtype=torch.int32)
                out = torch.empty_like(q)
                args = (q, k, v, tables, cu, lens)
                scale = head_dim**-0.5
                os.environ[decode.ENV] = "0"
                gather = _timed(partial(cpu_attention.paged_attention, *args))
                os.environ[decode.ENV] = "1"
                kernel = _timed(partial(decode.paged_decode, *args, scale, out))  # the default items
                per_head = _timed(partial(decode.paged_decode, *args, scale, out, work=decode.WORK_HEAD))
                # the same bytes stored head-major per block, viewed back as [blocks, bs, KVH, D]
                k_alt = k.transpose(1, 2).contiguous().transpose(1, 2)
                v_alt = v.transpose(1, 2).contiguous().transpose(1, 2)
                alt_args = (q, k_alt, v_alt, tables, cu, lens)
                alt = min(_timed(partial(decode.paged_decode, *alt_args, scale, out, work=work))
                          for work in (decode.WORK_SEQUENCE, decode.WORK_HEAD))
                ours = min(kernel, per_head)
                row = {"dtype": str(dtype).removeprefix("torch."), "batch": B, "context": L,
                       "kv_mb": kv_bytes / 2**20, "gather_ms": gather * 1e3, "kernel_ms": kernel * 1e3,
                       "kernel_per_head_ms": per_head * 1e3, "vllm_layout_ms": alt * 1e3,
                       "speedup": gather / kernel, "kernel_gb_per_s": kv_bytes / kernel / 1e9,
                       "vllm_over_ours": alt / ours}
                rows.append(row)
                print(f"  {row['dtype']:8s} {B:4d} {L:5d} {row['kv_mb']:7.1f} {row['gather_ms']:8.3f} "
                      f"{row['kernel_ms']:8.3f} {row['speedup']:6.2f}x {row['kernel_gb_per_s']:6.1f} "
                      f"{row['kernel_per_head_ms']:11.3f} {row['vllm_layout_ms']:11.3f} "
                      f"{row['vllm_over_ours']:9.2f}")
                del k, v, k_alt, v_alt
    os.environ.pop(decode.ENV, None)
    return rows


def elementwise_micro(intermediate: int, quick: bool) -> list[dict]:
    """SiLU-and-mul alone at the model's intermediate size: ``kernels.fused``'s torch code (``silu(gate)
    .mul_(up)`` on the halves of ``gate_up``, what ran before) against the library's one-pass op, T rows
    of ``[gate | up]``, and their ratio."""
    from batchinfer.kernels import fused
    from batchinfer.kernels.cpu_ext import decode, elementwise

    if decode.library() is None:
        raise SystemExit(f"the CPU extension is unavailable: {decode.unavailable_reason()}")
    print(f"SiLU-and-mul alone, [T, 2 x {intermediate}] -> [T, {intermediate}], {torch.get_num_threads()} "
          f"threads; us per call ({'thread CPU' if CPU_CLOCK else 'wall'} time, best of 5)")
    print(f"  {'dtype':8s} {'T':>5s} {'torch':>9s} {'fused':>9s} {'ratio':>6s}")
    gen, rows = torch.Generator().manual_seed(0), []
    for dtype in (torch.float32, torch.bfloat16):
        for T in ((1, 256) if quick else (1, 8, 64, 256, 2048)):
            x = torch.randn(T, 2 * intermediate, generator=gen).to(dtype)
            # the same op (float32 differs in last bits: tests/test_cpu_fused_ops.py bounds them)
            assert (elementwise.silu_and_mul(x) != fused._silu_and_mul_torch(x)).float().mean() < 0.3
            torch_s = _timed(partial(fused._silu_and_mul_torch, x))
            fused_s = _timed(partial(elementwise.silu_and_mul, x))
            row = {"dtype": str(dtype).removeprefix("torch."), "rows": T, "torch_us": torch_s * 1e6,
                   "fused_us": fused_s * 1e6, "ratio": torch_s / fused_s}
            rows.append(row)
            print(f"  {row['dtype']:8s} {T:5d} {row['torch_us']:9.1f} {row['fused_us']:9.1f} "
                  f"{row['ratio']:5.2f}x")
    return rows


def linear_micro(model: nn.Module, quick: bool) -> list[dict]:
    """The model's linear shapes (one of each, plus the LM head) at 1-8 rows in bfloat16, one weight
    called again and again (a small one stays in cache): torch's ``F.linear`` against the GEMV,
    their ratio, and the weight bytes each reads per second."""
    from batchinfer.kernels.cpu_ext import decode, gemv

    if decode.library() is None:
        raise SystemExit(f"the CPU extension is unavailable: {decode.unavailable_reason()}")
    attn, mlp, config = model.layers[0].self_attn, model.layers[0].mlp, model.config
    shapes = {"qkv_proj": attn.qkv_proj.weight.shape, "o_proj": attn.o_proj.weight.shape,
              "gate_up_proj": mlp.gate_up_proj.weight.shape, "down_proj": mlp.down_proj.weight.shape,
              "lm_head": (config.vocab_size, config.hidden_size)}
    copy = copy_bandwidth()
    print(f"linear layers alone, bfloat16, {torch.get_num_threads()} threads; copy bandwidth (read + write) "
          f"{copy / 1e9:.1f} GB/s; us per call ({'thread CPU' if CPU_CLOCK else 'wall'} time, best of 5)")
    print(f"  {'layer':13s} {'N x K':>12s} {'rows':>4s} {'torch':>8s} {'gemv':>8s} {'speedup':>7s} "
          f"{'torch GB/s':>10s} {'gemv GB/s':>9s}")
    gen, rows = torch.Generator().manual_seed(0), []
    for name, (n, k) in shapes.items():
        w = (torch.randn(n, k, generator=gen) * k**-0.5).to(torch.bfloat16)
        for m in (1, 4) if quick else range(1, gemv.MAX_ROWS + 1):
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            torch_s = _timed(partial(F.linear, x, w))
            gemv_s = _timed(partial(gemv.linear, x, w))
            row = {"layer": name, "out_features": n, "in_features": k, "rows": m, "torch_us": torch_s * 1e6,
                   "gemv_us": gemv_s * 1e6, "speedup": torch_s / gemv_s,
                   "torch_gb_per_s": w.nbytes / torch_s / 1e9, "gemv_gb_per_s": w.nbytes / gemv_s / 1e9,
                   "copy_gb_per_s": copy / 1e9}
            rows.append(row)
            print(f"  {name:13s} {f'{n} x {k}':>12s} {m:4d} {row['torch_us']:8.1f} {row['gemv_us']:8.1f} "
                  f"{row['speedup']:6.2f}x {row['torch_gb_per_s']:10.1f} {row['gemv_gb_per_s']:9.1f}")
    return rows


def stream_micro(model: nn.Module, quick: bool) -> list[dict]:
    """Every linear weight of the model (each layer's four projections, then the LM head) multiplied
    once, one after the other, at 1-8 rows: the weights stream from memory as in a decode step of
    that many sequences. torch against the GEMV in float32, bfloat16 and float16, torch's packed int8 kernel
    against the int8 GEMV (``int8``; where VNNI runs, ``int8 f32`` is the kernel that widens the codes to
    float32 instead); GB/s of weights read and the ratio, beside the copy bandwidth."""
    from batchinfer.kernels.cpu_ext import gemv
    from batchinfer.workers.quant.linear import quantize_int8

    weights = [proj.weight.detach() for layer in model.layers
               for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                            layer.mlp.down_proj)]
    weights.append((model.embed_tokens if model.lm_head is None else model.lm_head).weight.detach())
    gen, rows, copy = torch.Generator().manual_seed(0), [], copy_bandwidth()
    print(f"the model's weights streamed ({len(weights)} matrices, each once a pass), "
          f"{torch.get_num_threads()} threads; copy bandwidth (read + write) {copy / 1e9:.1f} GB/s; "
          "ms per pass, best of 5")
    print(f"  {'weights':8s} {'rows':>4s} {'MB':>7s} {'torch':>8s} {'ours':>8s} {'speedup':>7s} "
          f"{'torch GB/s':>10s} {'ours GB/s':>9s}")

    def one(kind: str, m: int, nbytes: int, torch_pass, our_pass) -> None:
        torch_s, ours_s = _timed(torch_pass), _timed(our_pass)
        row = {"weights": kind, "rows": m, "mb": nbytes / 1e6, "torch_ms": torch_s * 1e3,
               "ours_ms": ours_s * 1e3, "speedup": torch_s / ours_s, "torch_gb_per_s": nbytes / torch_s / 1e9,
               "ours_gb_per_s": nbytes / ours_s / 1e9, "copy_gb_per_s": copy / 1e9}
        rows.append(row)
        print(f"  {kind:8s} {m:4d} {row['mb']:7.1f} {row['torch_ms']:8.2f} {row['ours_ms']:8.2f} "
              f"{row['speedup']:6.2f}x {row['torch_gb_per_s']:10.1f} {row['ours_gb_per_s']:9.1f}")

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        ws = [w.to(dtype).contiguous() for w in weights]
        nbytes = sum(w.nbytes for w in ws)
        for m in (1, 4) if quick else (1, 2, 4, 8):
            xs = {k: torch.randn(m, k, generator=gen).to(dtype) for k in {w.shape[1] for w in ws}}
            one(str(dtype).removeprefix("torch."), m, nbytes,
                lambda ws=ws, xs=xs: [F.linear(xs[w.shape[1]], w) for w in ws],
                lambda ws=ws, xs=xs: [gemv.linear(xs[w.shape[1]], w) for w in ws])
        del ws
    if gemv.int8_runs():
        codes = [quantize_int8(w) for w in weights]
        nbytes = sum(q.nbytes for q, _ in codes)
        for m in (1, 4) if quick else (1, 2, 4):
            xs = {k: torch.randn(m, k, generator=gen).to(torch.bfloat16)
                  for k in {q.shape[1] for q, _ in codes}}
            one("int8", m, nbytes,
                lambda xs=xs: [torch._weight_int8pack_mm(xs[q.shape[1]], q, s) for q, s in codes],
                lambda xs=xs: [gemv.linear_int8(xs[q.shape[1]], q, s) for q, s in codes])
            if gemv.int8_vnni():  # the float32 kernel beside the VNNI one, in the same run
                one("int8 f32", m, nbytes,
                    lambda xs=xs: [torch._weight_int8pack_mm(xs[q.shape[1]], q, s) for q, s in codes],
                    lambda xs=xs: [gemv.linear_int8(xs[q.shape[1]], q, s, widen=True) for q, s in codes])
        if gemv.int8_vnni():  # 5-8 rows: against the GEMV on the dense bfloat16 copy QuantizedLinear keeps
            print("  int8/bf16: the VNNI kernel at 5-8 rows; its 'torch' column is the GEMV on the dense "
                  "bfloat16 copy of the same codes (what a layer ran there before)")
            dense = [(q.float() * s.float()[:, None]).to(torch.bfloat16) for q, s in codes]
            for m in (8,) if quick else (5, 6, 8):
                xs = {k: torch.randn(m, k, generator=gen).to(torch.bfloat16)
                      for k in {q.shape[1] for q, _ in codes}}
                one("int8/bf16", m, nbytes,
                    lambda xs=xs: [gemv.linear(xs[w.shape[1]], w) for w in dense],
                    lambda xs=xs: [gemv.linear_int8(xs[q.shape[1]], q, s) for q, s in codes])
    else:
        print("  int8: the int8 GEMV does not run on this CPU (it needs AVX-512)")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small smoke version (seconds): --workload quick")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="full",
                    help="full: 256 requests, prompts 32-512, 32-256 out; small: 64 requests, prompts "
                         "32-384, 64 out (issue 16); quick: a smoke test")
    ap.add_argument("--no-transformers", action="store_true", help="skip the transformers comparison")
    ap.add_argument("--profile", action="store_true", help="print a torch profiler table of the engine run")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--model", default=None,
                    help="HF folder or .gguf file, or 'demo' (SmolLM2-135M-Instruct) [a random ~20M Llama]")
    ap.add_argument("--decode-kernel", choices=("both", "on", "off"), default="both",
                    help="run the engine with the compiled CPU decode kernel, without it "
                         "(BATCHINFER_CPU_DECODE_KERNEL=0), or both one after the other [both]")
    ap.add_argument("--attention", action="store_true",
                    help="only the decode-attention micro-bench (kernel vs gather, our layout vs vLLM's) "
                         "at the model's head shapes")
    ap.add_argument("--ragged", action="store_true",
                    help="with --attention: each sequence's length drawn from [L/4, L] (an engine batch's "
                         "ragged contexts) instead of all L")
    ap.add_argument("--linear", action="store_true",
                    help="only the few-row linear micro-bench (torch's F.linear vs the GEMV, bfloat16) "
                         "at the model's shapes")
    ap.add_argument("--elementwise", action="store_true",
                    help="only the SiLU-and-mul micro-bench (torch's two ops vs the library's one) at the "
                         "model's intermediate size")
    ap.add_argument("--block-size", type=int, default=16,
                    help="tokens per KV block of the engine run and of --attention's caches (default 16, "
                         "the engine's default)")
    ap.add_argument("--cpu-clock", action="store_true",
                    help="time with the main thread's CPU time instead of wall time (use with --threads 1 "
                         "on a shared machine: other processes' load then barely shows)")
    args = ap.parse_args()
    global CPU_CLOCK
    CPU_CLOCK = args.cpu_clock
    if args.cpu_clock and (args.threads or torch.get_num_threads()) != 1:
        raise SystemExit("--cpu-clock counts the main thread only: use it with --threads 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    w = QUICK if args.quick else WORKLOADS[args.workload]
    prompts, outputs = workload(w["requests"], w["prompt"], w["output"])
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            model_dir = make_tiny_model(Path(tmp) / "llama-20m", "LlamaForCausalLM", **MODEL)
        else:
            model_dir = demo_gguf() if args.model == "demo" else Path(args.model)
        model = LLM(model_dir, num_kv_blocks=1).engine.model
        params = sum(t.numel() for t in model.parameters())
        print(f"model: {model_dir.name}, {model.config.architecture} {params / 1e6:.1f}M parameters, "
              f"float32, {torch.get_num_threads()} threads")
        if args.linear:
            rows = linear_micro(model, args.quick)
            streamed = stream_micro(model, args.quick)
            print(json.dumps({"linear": [{k: round(v, 4) if isinstance(v, float) else v
                                          for k, v in r.items()} for r in rows],
                              "streamed": [{k: round(v, 4) if isinstance(v, float) else v
                                            for k, v in r.items()} for r in streamed]}))
            return
        if args.elementwise:
            rows = elementwise_micro(model.config.intermediate_size, args.quick)
            print(json.dumps({"elementwise": [{k: round(v, 4) if isinstance(v, float) else v
                                               for k, v in r.items()} for r in rows]}))
            return
        if args.attention:
            rows = attention_micro(model.config.num_attention_heads, model.num_kv_heads, model.head_dim,
                                   args.quick, args.ragged, args.block_size)
            print(json.dumps({"attention": [{k: round(v, 4) if isinstance(v, float) else v
                                             for k, v in r.items()} for r in rows]}))
            return
        print(f"workload: {len(prompts)} requests, prompts {w['prompt']}, outputs {w['output']}, "
              f"{sum(map(len, prompts))} prompt and {sum(outputs)} output tokens")
        modes = ("on", "off") if args.decode_kernel == "both" else (args.decode_kernel,)
        bandwidth = copy_bandwidth()
        runs = {}
        for mode in modes:
            os.environ[decode_kernel_env()] = "1" if mode == "on" else "0"
            # Profiled: no replays, so the profile is the engine's own time (and no efficiencies).
            replay_every = 0 if args.profile else 4
            wall, tokens, efficiency, stats, flops = run_engine(model_dir, prompts, outputs, replay_every,
                                                                profile=args.profile,
                                                                block_size=args.block_size)
            runs[mode] = (wall, tokens, efficiency, flops)
            print(f"batchinfer LLM, decode kernel {mode:3s}: {wall:8.1f} s  {tokens / wall:8.1f} output "
                  f"tokens/s  ({stats['steps']} steps, {stats['tokens_per_step']:.0f} tokens/step, "
                  f"{stats['preemptions']} preemptions)")
        os.environ.pop(decode_kernel_env(), None)
        bandwidth = max(bandwidth, copy_bandwidth())  # the better of before and after: the stricter ceiling
        wall, tokens, efficiency, flops = runs[modes[0]]
        engine_tps = tokens / wall
        total = sum(flops.flops.values())
        if total == 0:  # the step's inputs are counted from ModelRunner.prepare
            raise SystemExit("no step went through ModelRunner.prepare: the FLOP count needs its inputs")
        model_rate = total / wall
        matmul_rate = flops.ceiling_flops / flops.ceiling_time if flops.ceiling_time else None
        shares = ", ".join(f"{k} {v / total:.0%}" for k, v in flops.flops.items())
        print(f"model FLOPs: {total / 1e12:.2f} TFLOP ({shares}); engine {model_rate / 1e9:.1f} GFLOP/s"
              + ("" if matmul_rate is None else
                 f"; plain matmuls of the model's shapes {matmul_rate / 1e9:.1f} GFLOP/s"))
        print(f"bytes: {flops.bytes / 1e9:.1f} GB (weights once per step + the K/V attention reads); "
              f"decode rows read {flops.decode_kv_bytes / 1e9:.1f} GB of K/V "
              f"(~{cfg_intensity(model):.1f} FLOP per byte: memory-bound); copy_ {bandwidth / 1e9:.1f} GB/s "
              f"(read + write)")
        roofs = {mode: runs[mode][3].roofline(bandwidth) for mode in modes}
        for mode, roof in roofs.items():
            if roof is not None:
                print(f"roofline, decode kernel {mode:3s}: ceiling {roof['ceiling_s']:.2f} s of the replayed "
                      f"steps' {roof['engine_s']:.2f} s ({roof['memory_bound_share']:.0%} of them "
                      f"memory-bound): efficiency {roof['efficiency']:.2f} (target >= 0.8)")
                print(f"  per op (the decode rows' K/V read after the matmuls): ceiling "
                      f"{roof['serial_ceiling_s']:.2f} s, efficiency {roof['serial_efficiency']:.2f}")
        if len(modes) == 2:
            on, off = (runs[m][1] / runs[m][0] for m in modes)
            print(f"decode kernel on vs off: {on:.1f} vs {off:.1f} output tokens/s ({on / off:.2f}x)")
        hf_tps = None
        if not args.no_transformers:
            hf_wall, hf_tokens = run_transformers(model_dir, prompts, outputs, w["hf_batch"])
            hf_tps = hf_tokens / hf_wall
            print(f"transformers:     {hf_wall:8.1f} s  {hf_tps:8.1f} output tokens/s  "
                  f"(static batches of {w['hf_batch']})")
            print(f"ratio: {engine_tps / hf_tps:.2f}x")
        if efficiency is not None:
            print(f"engine efficiency: {efficiency:.2f}")

    def rounded(x: float | None, digits: int) -> float | None:
        return None if x is None else round(x, digits)

    def roof(mode: str, key: str = "efficiency") -> float | None:
        r = roofs.get(mode)
        return None if r is None else round(r[key], 3)

    off_tps = runs["off"][1] / runs["off"][0] if "off" in runs else None
    print(json.dumps({"tokens_per_s": round(engine_tps, 2), "transformers_tokens_per_s": rounded(hf_tps, 2),
                      "ratio": None if hf_tps is None else round(engine_tps / hf_tps, 3),
                      "efficiency": rounded(efficiency, 3),
                      "model_gflops_per_s": round(model_rate / 1e9, 2),
                      "matmul_gflops_per_s": None if matmul_rate is None else round(matmul_rate / 1e9, 2),
                      "copy_gb_per_s": round(bandwidth / 1e9, 2),
                      "roofline_efficiency": roof(modes[0]),
                      "serial_roofline_efficiency": roof(modes[0], "serial_efficiency"),
                      "decode_kernel": modes[0],
                      "tokens_per_s_kernel_off": rounded(off_tps, 2) if len(modes) == 2 else None,
                      "roofline_efficiency_kernel_off": roof("off") if len(modes) == 2 else None}))


def decode_kernel_env() -> str:
    """The decode kernel's switch, ``BATCHINFER_CPU_DECODE_KERNEL`` (read on every attention call)."""
    from batchinfer.kernels.cpu_ext import decode

    return decode.ENV


if __name__ == "__main__":
    main()
