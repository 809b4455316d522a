"""``TPGroup``: one rank's view of a tensor-parallel group (torch.distributed) and its collectives.

Every rank process (rank 0 is the engine's own process) calls ``TPGroup.init`` with the same
``init_method`` (e.g. ``"tcp://127.0.0.1:PORT"``), ``size`` and ``backend``: ``"gloo"`` on the
CPU, ``"nccl"`` on CUDA. A ``Decoder`` built with the group holds that rank's shard and calls
the collectives below inside its forward (``workers/models/sharding.py`` has the split).

Every collective is bounded by ``timeout_s``: a rank that is gone makes the others raise
``TPGroupError`` (gloo: at once on a closed connection, else at the timeout) instead of hanging;
NCCL collectives are stream-ordered, and its watchdog (``TORCH_NCCL_ASYNC_ERROR_HANDLING``) takes
the process down at the timeout. ``TPGroup.single()`` (size 1) has no process group and its
collectives return their input: code written for N ranks runs unchanged on one.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")
DEFAULT_TIMEOUT_S = 120.0


class TPGroupError(RuntimeError):
    """A tensor-parallel rendezvous or collective failed (a taken port, a missing or dead rank)."""


@dataclass
class TPGroup:
    """Rank ``rank`` of ``size`` ranks; ``device`` is where this rank's shard and collectives live."""

    rank: int
    size: int
    device: torch.device
    timeout_s: float = DEFAULT_TIMEOUT_S
    backend: str = "gloo"
    group: dist.ProcessGroup | None = None  # None: size 1, no communication
    broken: bool = False  # a collective failed: the group is unusable (see ``close``)

    @classmethod
    def single(cls, device: str | torch.device = "cpu") -> TPGroup:
        """No parallelism: one rank, no process group; a ``Decoder`` given it is unsharded."""
        return cls(rank=0, size=1, device=torch.device(device))

    @classmethod
    def init(cls, rank: int, size: int, init_method: str, backend: str = "gloo",
             device: str | torch.device = "cpu", timeout_s: float = DEFAULT_TIMEOUT_S) -> TPGroup:
        """Join the group (blocks until all ``size`` ranks have joined, at most ``timeout_s``).

        Raises ``ValueError`` for a bad rank / size / backend / device and ``TPGroupError`` when
        the rendezvous fails (the port is taken, or a rank never arrived within the timeout).
        """
        if size < 1:
            raise ValueError(f"tensor parallel size must be >= 1, got {size}")
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is out of range for tensor parallel size {size}")
        if backend not in BACKENDS:
            raise ValueError(f"tensor parallel backend {backend!r} is not supported; use one of "
                             f"{', '.join(BACKENDS)}")
        if not timeout_s > 0:
            raise ValueError(f"tensor parallel timeout must be > 0 seconds, got {timeout_s}")
        device = torch.device(device)
        if backend == "nccl" and device.type != "cuda":
            raise ValueError(f"the nccl backend needs a CUDA device, rank {rank} was given {device}")
        if backend == "gloo" and device.type != "cpu":
            raise ValueError(f"the gloo backend runs on the CPU, rank {rank} was given {device} (use nccl)")
        if size == 1:
            return cls(rank=0, size=1, device=device, timeout_s=timeout_s, backend=backend)
        if dist.is_initialized():
            raise TPGroupError("this process already belongs to a torch.distributed group: close() "
                               "(or delete) the tensor-parallel LLM / Engine that holds it first")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        # NCCL: abort (and raise) on a collective that outlives the timeout instead of hanging.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                    timeout=timeout)
        except Exception as e:  # DistNetworkError / DistStoreError / RuntimeError, by torch version
            if dist.is_initialized():
                dist.destroy_process_group()
            else:
                _forget_group_name()
            raise TPGroupError(
                f"tensor parallel rendezvous failed for rank {rank} of {size} at {init_method} "
                f"({backend}, timeout {timeout_s:g} s): {type(e).__name__}: {str(e).splitlines()[0]} "
                "(is the port taken by another process, or did a rank fail to start?)"
            ) from None
        group = dist.group.WORLD
        tp = cls(rank=rank, size=size, device=device, timeout_s=timeout_s, backend=backend, group=group)
        tp.barrier()  # every rank has joined and the transport works both ways
        return tp

    @property
    def is_parallel(self) -> bool:
        return self.size > 1

    def _solo(self) -> bool:
        """True when there is nobody to talk to (size 1); a closed group of N ranks is an error."""
        if self.group is not None:
            return False
        if self.size > 1:
            raise TPGroupError(f"tensor parallel group of rank {self.rank} is closed")
        return True

    def _run(self, what: str, op: Callable[[bool], Any]) -> None:
        """Run ``op(async_op)`` (a torch.distributed call), raising ``TPGroupError`` when it fails.

        gloo: asynchronously, then waited on for at most the timeout. NCCL: enqueued on the
        current stream (a wait with a timeout would block the CPU on the GPU at every collective
        and cannot be captured in a CUDA graph); the process group's watchdog enforces the timeout.
        """
        try:
            if self.backend == "nccl":
                op(False)
            else:
                op(True).wait(datetime.timedelta(seconds=self.timeout_s))
        except Exception as e:
            self.broken = True
            first = str(e).splitlines()[0] if str(e) else ""
            raise TPGroupError(f"tensor parallel {what} failed on rank {self.rank} of {self.size} "
                               f"(a rank died or stalled past {self.timeout_s:g} s?): "
                               f"{type(e).__name__}: {first}") from None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns ``x``."""
        if self._solo():
            return x
        self._run("all_reduce", lambda a: dist.all_reduce(x, group=self.group, async_op=a))
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``x`` (same shape on each), concatenated along ``dim`` in rank order."""
        if self._solo():
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self._run("all_gather", lambda a: dist.all_gather(parts, x, group=self.group, async_op=a))
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``x`` of rank ``src`` copied into ``x`` on every rank (in place); returns ``x``."""
        if self._solo():
            return x
        self._run("broadcast", lambda a: dist.broadcast(x, src=src, group=self.group, async_op=a))
        return x

    def all_reduce_min_int(self, n: int) -> int:
        """The smallest ``n`` over the ranks (e.g. the KV blocks every rank can hold)."""
        if self._solo():
            return int(n)
        t = torch.tensor([int(n)], dtype=torch.int64, device=self.device)
        self._run("all_reduce(min)",
                  lambda a: dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group, async_op=a))
        return int(t.item())

    def barrier(self) -> None:
        """Return once every rank has reached it (a one-element all-reduce: bounded by the timeout)."""
        if self._solo():
            return
        self.all_reduce(torch.zeros(1, device=self.device)).item()  # .item(): NCCL's is stream-ordered

    def close(self) -> None:
        """Leave the group (idempotent); the process may then ``init`` a new one.

        A broken group (a collective failed) is only dropped: tearing it down talks to the dead
        peers. gloo may then abort at interpreter shutdown (its transport threads were never
        joined), so a process whose group broke should report and leave with ``os._exit``.
        """
        if self.group is not None and dist.is_initialized() and not self.broken:
            dist.destroy_process_group()
        self.group = None


def _forget_group_name() -> None:
    """Undo the group name a failed ``init_process_group`` took. torch numbers default groups per
    process and resets the count only in ``destroy_process_group``, which a group never made cannot
    call: the next group of this process would be named "1" where its fresh ranks say "0", and
    their rendezvous would wait for each other's keys until the timeout."""
    world = getattr(dist.distributed_c10d, "_world", None)
    if world is not None and hasattr(world, "group_count"):
        world.group_count = 0
