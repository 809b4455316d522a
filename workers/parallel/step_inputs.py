"""``StepChannel``: how rank 0 hands each step's inputs to the other tensor-parallel ranks.

Rank 0 builds a step's host index arrays once (``ModelRunner``: token ids, positions, KV slots,
block tables, query offsets, sequence lengths, sampled rows), packs them into one int64 buffer in
shared memory and wakes every rank through a ``multiprocessing`` semaphore of its own: nano-vllm's
design, with a semaphore where it has an Event (``Event.set`` waits until the woken process has
acknowledged, a round trip per rank per step; a semaphore's release is one ``sem_post``). Each
rank copies the step out of the buffer and runs its shard of the forward.

Why shared memory and not a ``torch.distributed`` broadcast of the packed tensor: between steps
(a worker waiting for work) the ranks must wait for as long as it takes, and a collective that
waits is bounded by the group's timeout (gloo and NCCL alike): the ranks would fail on an idle
worker. A semaphore waits without a deadline while the rank's parent watchdog still runs. It is
also cheaper: one memcpy however many ranks, and no second collective for the step's size
(docs/benchmarks.md has both measured: ``bench/tp_cpu.py``).

Reuse of the buffer is safe without a second handshake: rank 0 writes step k+1 only after its
step k forward returned, which needs every rank in step k's collectives, which each rank enters
only after it copied step k out (so a semaphore never counts above 1). The buffer is a
``RawArray`` (an unlinked file mapped by both sides): nothing is left in ``/dev/shm`` when a
process is killed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

HEADER = 9  # seq, kind, S, T, M, N, max_seqlen_q, max_seqlen_k, sent at (monotonic ns)
STEP, SHUTDOWN = 1, 2
# The host arrays in packing order, with the dtype the runner builds them in.
FIELDS = (("input_ids", np.int64), ("positions", np.int64), ("slot_mapping", np.int64),
          ("block_tables", np.int32), ("cu_seqlens_q", np.int32), ("seq_lens", np.int32),
          ("sample_indices", np.int64))


def capacity(max_tokens: int, max_seqs: int, max_blocks_per_seq: int) -> int:
    """int64 elements the payload of any step within these bounds needs."""
    return 3 * max_tokens + max_seqs * max_blocks_per_seq + 3 * max_seqs + 1


@dataclass
class Step:
    """One step as a rank received it: the host arrays (private copies) and the two lengths."""

    host: dict[str, np.ndarray]
    max_seqlen_q: int
    max_seqlen_k: int
    latency_ns: int  # rank 0's write -> this rank awake and holding its copy


class StepChannel:
    """Shared buffer + one semaphore per rank 1..N-1; built by rank 0 before the ranks are spawned
    (both kinds of object travel to a child only at its start)."""

    def __init__(self, ctx: Any, size: int, max_tokens: int, max_seqs: int, max_blocks_per_seq: int) -> None:
        self.size = size
        self.capacity = capacity(max_tokens, max_seqs, max_blocks_per_seq)
        self.buffer = ctx.RawArray("q", HEADER + self.capacity)  # zero-filled; int64
        self.wakeups = [ctx.Semaphore(0) for _ in range(size - 1)]  # released once per message
        self._seq = 0
        self._array: np.ndarray | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_array"] = None  # a view of this process's mapping; the child makes its own
        return state

    @property
    def array(self) -> np.ndarray:
        if self._array is None:
            self._array = np.frombuffer(self.buffer, dtype=np.int64)
        return self._array

    # -- rank 0 -----------------------------------------------------------------------------------

    def send(self, host: dict[str, np.ndarray], max_seqlen_q: int, max_seqlen_k: int) -> None:
        """Publish one step (``host`` holds ``FIELDS``) and wake every rank."""
        S, T = host["seq_lens"].size, host["input_ids"].size
        M, N = host["block_tables"].shape[1], host["sample_indices"].size
        n = sum(host[name].size for name, _ in FIELDS)
        if n > self.capacity:  # the scheduler's budgets rule it out; a broken bound is a bug
            raise ValueError(f"step of {S} sequences, {T} tokens, {M} blocks each needs {n} int64 slots; "
                             f"the step channel holds {self.capacity}")
        a, at = self.array, HEADER
        for name, _ in FIELDS:
            part = host[name].reshape(-1)
            a[at:at + part.size] = part  # int32 arrays widen here
            at += part.size
        self._seq += 1
        a[:HEADER] = (self._seq, STEP, S, T, M, N, max_seqlen_q, max_seqlen_k, time.monotonic_ns())
        for wakeup in self.wakeups:
            wakeup.release()

    def shutdown(self) -> None:
        """Tell every rank to leave its loop."""
        self._seq += 1
        self.array[:3] = (self._seq, SHUTDOWN, 0)
        for wakeup in self.wakeups:
            wakeup.release()

    # -- ranks 1..N-1 ---------------------------------------------------------------------------

    def receive(self, rank: int, poll_s: float = 1.0) -> Step | None:
        """Wait (without a deadline) for rank 0's next step; None for a shutdown."""
        wakeup = self.wakeups[rank - 1]
        while not wakeup.acquire(timeout=poll_s):  # the rank's parent watchdog runs meanwhile
            pass
        a = self.array
        _seq, kind, S, T, M, N, max_q, max_k, sent = (int(v) for v in a[:HEADER])
        if kind == SHUTDOWN:
            return None
        sizes = {"input_ids": T, "positions": T, "slot_mapping": T, "block_tables": S * M,
                 "cu_seqlens_q": S + 1, "seq_lens": S, "sample_indices": N}
        payload = a[HEADER:HEADER + sum(sizes.values())].copy()  # private: rank 0 reuses the buffer
        host, at = {}, 0
        for name, dtype in FIELDS:
            part = payload[at:at + sizes[name]]
            host[name] = part if dtype == np.int64 else part.astype(dtype)
            at += sizes[name]
        host["block_tables"] = host["block_tables"].reshape(S, M)
        return Step(host, max_q, max_k, time.monotonic_ns() - sent)
