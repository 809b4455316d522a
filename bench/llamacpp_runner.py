"""llama.cpp's side of ``bench/peer_llamacpp.py``: run in the bench venv (stdlib + llama_cpp + numpy).

Reads one JSON object on stdin::

    {"model": "x.gguf", "prompts": [[token ids], ...], "n_out": 64, "threads": 1,
     "concurrency": 8, "n_batch": 2048, "n_ubatch": 512, "kv_unified": false}

and prints one JSON object on stdout: ``outputs`` (each request's ``n_out`` greedy token ids, in
input order), ``wall_s`` (first decode to last), ``tokens_per_s`` (output tokens / wall_s), ``n_ctx``,
``steps`` (llama_decode calls), ``load_s`` and ``system_info`` (``llama_print_system_info``: the CPU
features ggml was built with, AMX_INT8 among them).

It schedules as llama.cpp's server does with parallel slots: ``concurrency`` sequences in flight, a
new one starting when one finishes (its KV removed with ``llama_memory_seq_rm``); every step is ONE
``llama_decode`` of a batch that holds one token of each generating sequence first, then prompt
chunks of new sequences up to ``n_batch`` tokens (llama.cpp splits it into ``n_ubatch`` ubatches).
The next token is the argmax of ``llama_get_logits_ith``; EOS does not stop a sequence.

The context is built with the low-level API, not ``llama_cpp.Llama``: ``Llama`` (0.3.36) gives
its context ``n_seq_max`` 1 (it takes no ``n_seq_max`` argument), so sequence ids above 0 would be
refused. With ``kv_unified`` false each sequence gets its own ``n_ctx / n_seq_max`` KV stream, so
``n_ctx`` is ``concurrency`` x the longest request rounded up to 256.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections import deque

import llama_cpp
import numpy as np


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class Runner:
    """One model and one context sized for ``concurrency`` sequences of up to ``max_len`` tokens."""

    def __init__(self, model_path: str, concurrency: int, max_len: int, threads: int, n_batch: int,
                 n_ubatch: int, kv_unified: bool) -> None:
        quiet = not os.environ.get("LLAMA_VERBOSE")  # llama.cpp's load chatter, unless asked for
        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR if quiet else logging.DEBUG)
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(model_path.encode(),
                                                          llama_cpp.llama_model_default_params())
        if not self.model:
            raise SystemExit(f"llama.cpp could not load {model_path} (run with LLAMA_VERBOSE=1 to see why)")
        params = llama_cpp.llama_context_default_params()
        self.n_ctx = concurrency * _round_up(max_len, 256)
        params.n_ctx = self.n_ctx
        params.n_batch = n_batch
        params.n_ubatch = min(n_ubatch, n_batch)
        params.n_seq_max = concurrency
        params.n_threads = threads
        params.n_threads_batch = threads
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        params.no_perf = True
        if "kv_unified" in {name for name, _ in params._fields_}:
            params.kv_unified = kv_unified
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise SystemExit(f"llama.cpp could not make a context of n_ctx {self.n_ctx}, "
                             f"n_seq_max {concurrency}")
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.n_batch = n_batch
        self.concurrency = concurrency
        self.batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
        self.steps = 0

    def close(self) -> None:
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)
        llama_cpp.llama_model_free(self.model)

    def _add(self, token: int, pos: int, seq: int, logits: bool) -> int:
        b, i = self.batch, self.batch.n_tokens
        b.token[i], b.pos[i], b.n_seq_id[i], b.seq_id[i][0], b.logits[i] = token, pos, 1, seq, logits
        b.n_tokens = i + 1
        return i

    def _argmax(self, i: int) -> int:
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))
        return int(logits.argmax())

    def run(self, prompts: list[list[int]], n_out: int) -> list[list[int]]:
        """Every prompt's ``n_out`` greedy tokens, ``concurrency`` sequences in flight."""
        outputs: list[list[int]] = [[] for _ in prompts]
        waiting = deque(range(len(prompts)))
        free = list(range(self.concurrency - 1, -1, -1))  # seq ids (the server's slots)
        active: dict[int, list[int]] = {}  # seq -> [request, tokens in its KV]
        while waiting or active:
            while free and waiting:
                active[free.pop()] = [waiting.popleft(), 0]
            self.batch.n_tokens = 0
            advanced: dict[int, int] = {}  # seq -> tokens this step adds to its KV
            sampled: list[tuple[int, int]] = []  # (seq, batch index whose logits give its next token)
            for seq, (req, n_past) in active.items():  # generating sequences: their last token each
                if n_past >= len(prompts[req]):
                    sampled.append((seq, self._add(outputs[req][-1], n_past, seq, True)))
                    advanced[seq] = 1
            for seq, (req, n_past) in active.items():  # then prompt chunks while the batch has room
                prompt, room = prompts[req], self.n_batch - self.batch.n_tokens
                if n_past >= len(prompt) or room <= 0:
                    continue
                chunk = prompt[n_past:n_past + room]
                ends = n_past + len(chunk) == len(prompt)
                for j, tok in enumerate(chunk):
                    i = self._add(tok, n_past + j, seq, ends and j == len(chunk) - 1)
                advanced[seq] = len(chunk)
                if ends:
                    sampled.append((seq, i))
            ret = llama_cpp.llama_decode(self.ctx, self.batch)
            if ret != 0:
                raise SystemExit(f"llama_decode returned {ret} (n_tokens {self.batch.n_tokens})")
            self.steps += 1
            for seq, n in advanced.items():
                active[seq][1] += n
            for seq, i in sampled:
                req = active[seq][0]
                outputs[req].append(self._argmax(i))
                if len(outputs[req]) == n_out:  # done: free the slot and its KV
                    llama_cpp.llama_memory_seq_rm(self.memory, seq, -1, -1)
                    del active[seq]
                    free.append(seq)
        return outputs


def main() -> None:
    job = json.load(sys.stdin)
    prompts = job["prompts"]
    n_out = int(job["n_out"])
    t0 = time.perf_counter()
    runner = Runner(job["model"], int(job["concurrency"]), max(map(len, prompts)) + n_out + 1,
                    int(job["threads"]), int(job.get("n_batch", 2048)), int(job.get("n_ubatch", 512)),
                    bool(job.get("kv_unified", False)))
    load_s = time.perf_counter() - t0
    runner.run([[1, 2, 3, 4]], 4)  # warm-up (first-call allocations), then an empty KV
    llama_cpp.llama_memory_clear(runner.memory, True)
    runner.steps = 0
    t0 = time.perf_counter()
    outputs = runner.run(prompts, n_out)
    wall = time.perf_counter() - t0
    json.dump({"outputs": outputs, "wall_s": wall, "tokens_per_s": sum(map(len, outputs)) / wall,
               "n_ctx": runner.n_ctx, "steps": runner.steps, "load_s": load_s,
               "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip()},
              sys.stdout)
    runner.close()


if __name__ == "__main__":
    main()
