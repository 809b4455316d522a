"""The rank processes of a tensor-parallel engine, and rank 0's handle on them.

``RankProcesses.start(config)`` (in the engine's process, rank 0) spawns ranks 1..N-1 with the
``spawn`` start method (a fresh interpreter: no forked CUDA context, no copied locks), joins the
``TPGroup`` with them and loads rank 0's shard. Each rank process (:func:`rank_main`) joins the
same group, loads its own shard, builds its own ``ModelRunner`` (same KV block count: the minimum
over ranks), says "ready" on its pipe, then loops: wait for a step on the ``StepChannel``, run its
shard of the forward and of ``compute_logits`` (the collectives meet rank 0's), repeat, until
a shutdown message.

Start-up talks over each rank's pipe, not in collectives, wherever one rank may wait long for
another: "hello" (its interpreter and imports are up; then the rendezvous), "loaded" (its shard
is in memory) answered by rank 0's "go" once every shard is, "ready" (its runner is built). Loading
a large shard takes minutes and unevenly, which no collective timeout should have to cover; a rank
that dies meanwhile is seen at once (its pipe and its exit code are watched), within
``START_TIMEOUT_S`` when it merely hangs.

Faults. A rank that dies makes rank 0's next step raise ``RankFailure`` promptly: the runner
checks the processes' liveness before each step, and every collective is bounded by the group's
timeout (gloo also fails at once on a peer's closed connection). A rank process watches its
parent and exits when the parent is gone (a SIGKILLed worker leaves nothing behind); it ignores
SIGINT / SIGTERM, which a terminal or a container runtime sends to the whole process group, so
that the engine's own shutdown (rank 0's ``close``: the shutdown message, then SIGKILL to a rank
that does not leave in time) decides when it ends.

Nothing torch is imported at module level: the worker daemon imports ``RankFailure`` (to exit
non-zero on it) without loading torch for an echo engine.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import multiprocessing as mp
import os
import signal
import socket
import threading
import time
import weakref
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import torch

    from batchinfer.workers.engine_config import EngineConfig
    from batchinfer.workers.models import Decoder
    from batchinfer.workers.parallel.group import TPGroup
    from batchinfer.workers.parallel.step_inputs import StepChannel

log = logging.getLogger(__name__)

PARENT_POLL_S = 0.2  # how often a rank checks that its parent is alive
START_TIMEOUT_S = 1800.0  # a rank that neither dies nor reaches the next start-up stage in this long
EXIT_GRACE_S = 5.0  # a rank told to shut down gets this long before SIGKILL
EXIT_PARENT_GONE = 4


class RankFailure(RuntimeError):
    """A tensor-parallel rank died, failed or stalled: this engine cannot run another step.

    The worker daemon exits non-zero on it (its batches return through their leases); ``LLM``
    users see it raised from ``generate``.
    """


def free_port() -> int:
    """A TCP port on 127.0.0.1 free now (the rendezvous binds it moments later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _cpu_threads(size: int) -> int:
    """Intra-op threads per rank when all ranks share the CPU: the cores split between them."""
    return max(1, (os.cpu_count() or 1) // size)


def wanted_model_len(config: EngineConfig, max_position_embeddings: int) -> int:
    """The model length the engine asks the runner for (``Engine``'s rule, shared by the ranks)."""
    return config.max_model_len or max_position_embeddings


class RankProcesses:
    """Rank 0's handle on ranks 1..N-1: the group, rank 0's shard, the step channel, the processes.

    Built by :meth:`start`; ``close`` (idempotent) shuts the ranks down and leaves the group. One
    dropped unclosed has its ranks killed and the group left when it is collected (``del llm``:
    the process may then start another TP engine), its ranks killed at interpreter exit.
    """

    def __init__(self, config: EngineConfig, tp: TPGroup, model: Decoder, channel: StepChannel,
                 procs: list[Any], conns: list[Connection]) -> None:
        self.config = config
        self.tp = tp
        self.model = model
        self.channel = channel
        self.procs = procs
        self.conns = conns
        self.messages: dict[int, str] = {}  # rank -> the error it reported
        self.stats: dict[int, dict[str, float]] = {}  # rank -> step-input latency it measured
        self.ready = False
        self.failed: str | None = None  # why a step failed: the ranks are out of step for good
        self.closed = False
        # Dropped without close() (``del llm``): the ranks are killed and the group left when this
        # is collected, so that the process can start another TP engine. At exit only killed: not
        # through finalize's own exit hook, which may run after multiprocessing's, which would
        # wait for the ranks forever.
        self._finalizer = weakref.finalize(self, _release, procs, conns, tp)
        self._finalizer.atexit = False
        self._at_exit = functools.partial(_reap, procs)
        atexit.register(self._at_exit)

    # -- start --------------------------------------------------------------------------------------

    @classmethod
    def start(cls, config: EngineConfig) -> RankProcesses:
        """Spawn ranks 1..N-1, join the group as rank 0 and load rank 0's shard.

        The ranks then build their runners; rank 0's ``ModelRunner`` (built by the engine next)
        meets them in the KV-capacity agreement, and :meth:`wait_ready` confirms they are serving.
        Raises ``ValueError`` for a model the size cannot split (every rank finds it), and
        ``RankFailure`` naming the rank, and its error, when a rank cannot start (or when the
        rendezvous fails: the port is taken).
        """
        import torch

        from batchinfer.workers.models import ModelConfig, load_model
        from batchinfer.workers.parallel.group import TPGroup
        from batchinfer.workers.parallel.step_inputs import StepChannel

        parallel = config.parallel
        size, devices = parallel.tensor_parallel_size, [torch.device(d) for d in parallel.devices]
        mc = ModelConfig.from_dir(config.model)
        longest = wanted_model_len(config, mc.max_position_embeddings)
        ctx = mp.get_context("spawn")
        channel = StepChannel(ctx, size, config.max_num_batched_tokens, config.max_num_seqs,
                              -(-longest // config.block_size))
        port = parallel.tp_port or free_port()
        init_method = f"tcp://127.0.0.1:{port}"
        if devices[0].type == "cpu":
            torch.set_num_threads(_cpu_threads(size))
        procs: list[Any] = []
        conns: list[Connection] = []
        tp: TPGroup | None = None
        try:
            for rank in range(1, size):
                parent_end, child_end = ctx.Pipe(duplex=True)
                proc = ctx.Process(target=rank_main, name=f"batchinfer-tp-rank{rank}", daemon=False,
                                   args=(rank, config, init_method, channel, child_end, os.getpid()))
                proc.start()
                child_end.close()
                procs.append(proc)
                conns.append(parent_end)
            _await(procs, conns, "hello", {})
            tp = TPGroup.init(0, size, init_method, _backend(devices[0]), devices[0], parallel.tp_timeout_s)
            model = load_model(config.model, config.dtype, devices[0], progress=True, tp=tp)
            _await(procs, conns, "loaded", {})
            for conn in conns:
                conn.send(("go", None))
        except BaseException as e:
            # ValueError: rank 0 found the model cannot be split (so does every rank): its own
            # message says it best. Anything else names a rank that died, with its error.
            wrap = isinstance(e, Exception) and not isinstance(e, (ValueError, RankFailure))
            failure = _Partial(procs, conns).failure(e, "start-up") if wrap else None
            _reap(procs)
            if tp is not None:
                tp.close()
            if failure is None:
                raise
            raise failure from e
        return cls(config, tp, model, channel, procs, conns)

    def wait_ready(self) -> list[int]:
        """Block until every rank reports its runner built (its KV block count, returned per rank);
        ``RankFailure`` when one fails or dies first."""
        blocks = [int(v) for v in _await(self.procs, self.conns, "ready", self.messages)]
        self.ready = True
        log.info("tensor parallelism: %d ranks ready (this process is rank 0; KV blocks per rank %s)",
                 len(self.procs) + 1, blocks)
        return blocks

    # -- steps --------------------------------------------------------------------------------------

    def send(self, host: dict[str, np.ndarray], max_seqlen_q: int, max_seqlen_k: int) -> None:
        """Hand one step's host arrays to every rank."""
        if self.closed:
            raise RankFailure("the tensor-parallel ranks are shut down")
        self.channel.send(host, max_seqlen_q, max_seqlen_k)

    def check(self) -> None:
        """``RankFailure`` naming the first rank process that is no longer running (or the step
        failure since which no step can run)."""
        if self.closed:
            raise RankFailure("the tensor-parallel ranks are shut down (the engine was closed)")
        if self.failed is not None:
            raise RankFailure(f"the tensor-parallel engine is broken since an earlier step: {self.failed}")
        for rank, proc in enumerate(self.procs, start=1):
            if proc.exitcode is not None:
                raise RankFailure(self._death(rank, proc))

    def failure(self, error: BaseException) -> RankFailure:
        """The ``RankFailure`` for ``error`` raised in a step: names a rank that died meanwhile."""
        if isinstance(error, RankFailure) and self.failed is not None:
            return error  # check() says it is broken since self.failed
        failure = error if isinstance(error, RankFailure) else \
            _Partial(self.procs, self.conns, self.messages).failure(error)
        self.failed = str(failure)
        return failure

    def _death(self, rank: int, proc: Any) -> str:
        self._drain(rank)
        return _describe(rank, proc, self.messages.get(rank))

    def _drain(self, rank: int) -> None:
        """Read what rank ``rank`` sent and rank 0 has not read (its error, its statistics)."""
        with contextlib.suppress(RankFailure):  # at its end of file: the rank is gone, as expected
            while self.conns[rank - 1].poll(0):
                self._recv(rank, self.conns[rank - 1])

    def _recv(self, rank: int, conn: Connection) -> tuple[str, Any]:
        try:
            kind, value = conn.recv()
        except (EOFError, OSError):
            proc = self.procs[rank - 1]
            proc.join(timeout=1.0)
            raise RankFailure(_describe(rank, proc, self.messages.get(rank))) from None
        if kind == "error":
            self.messages[rank] = str(value)
        elif kind == "stats":
            self.stats[rank] = dict(value)
        return kind, value

    # -- shutdown -----------------------------------------------------------------------------------

    def close(self) -> None:
        """Send the shutdown message, wait for the ranks (SIGKILL after ``EXIT_GRACE_S``), leave the
        group. Idempotent.

        After a failed step the group is only dropped, not torn down (that would talk to the dead
        peers; see ``TPGroup.close``): this process cannot join another group until it exits, which
        is what the worker daemon does.
        """
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self._at_exit)
        # Ranks that never reached their step loop (a failed start), or left it in a failed step,
        # cannot read the message: SIGKILL at once.
        graceful = self.ready and not self.failed and all(p.exitcode is None for p in self.procs)
        if graceful:
            self.channel.shutdown()
        deadline = time.monotonic() + (EXIT_GRACE_S if graceful else 0.0)
        for rank, proc in enumerate(self.procs, start=1):
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            self._drain(rank)  # the step-input latency a rank reports as it leaves
        self._finalizer()  # SIGKILL to whatever is left, reap, leave the group

    def step_input_latency(self) -> dict[int, dict[str, float]]:
        """Per rank, as measured there: steps received and the mean / max microseconds from rank 0's
        write to the rank holding its copy (reported when the rank shuts down)."""
        return dict(self.stats)


class _Partial:
    """Failure reports over processes that may not all have started (start-up) or a live set."""

    def __init__(self, procs: list[Any], conns: list[Connection], messages: dict[int, str] | None = None):
        self.procs, self.conns = procs, conns
        self.messages = messages if messages is not None else {}

    def failure(self, error: BaseException, what: str = "step") -> RankFailure:
        # A killed peer breaks rank 0's collective at once, before its exit is visible: wait a moment.
        deadline = time.monotonic() + 1.0
        dead: list[tuple[int, Any]] = []
        while not dead and time.monotonic() < deadline:
            dead = [(r, p) for r, p in enumerate(self.procs, start=1) if p.exitcode is not None]
            if not dead:
                time.sleep(0.05)
        for rank, conn in enumerate(self.conns, start=1):
            try:
                while conn.poll(0):
                    kind, value = conn.recv()
                    if kind == "error":
                        self.messages[rank] = str(value)
            except (EOFError, OSError):
                pass
        cause = f"{type(error).__name__}: {error}"
        if dead:
            return RankFailure("; ".join(_describe(r, p, self.messages.get(r)) for r, p in dead)
                               + f" (rank 0: {cause})")
        if self.messages:
            return RankFailure("; ".join(f"tensor-parallel rank {r} failed: {m}"
                                         for r, m in sorted(self.messages.items())) + f" (rank 0: {cause})")
        return RankFailure(f"tensor-parallel {what} failed on rank 0: {cause}")


def _await(procs: list[Any], conns: list[Connection], stage: str, messages: dict[int, str]) -> list[Any]:
    """Every rank's ``stage`` message (its value, per rank) of the start-up; ``RankFailure`` naming
    a rank that reports an error, dies or stalls (``START_TIMEOUT_S``) first."""
    deadline = time.monotonic() + START_TIMEOUT_S
    values = []
    for rank, (proc, conn) in enumerate(zip(procs, conns, strict=True), start=1):
        while not conn.poll(0.05):
            if proc.exitcode is not None:
                why = messages.get(rank)
                if why is None and stage == "hello":
                    why = ("it died before reaching rank_main (a spawned interpreter re-imports the "
                           "main module: guard a script's code with `if __name__ == '__main__':`)")
                raise RankFailure(_describe(rank, proc, why))
            if time.monotonic() > deadline:
                raise RankFailure(f"tensor-parallel rank {rank} (pid {proc.pid}) did not report "
                                  f"{stage!r} within {START_TIMEOUT_S:g} s")
        try:
            kind, value = conn.recv()
        except (EOFError, OSError):
            proc.join(timeout=1.0)
            raise RankFailure(_describe(rank, proc, messages.get(rank))) from None
        if kind == "error":
            messages[rank] = str(value)
            proc.join(timeout=5.0)
            raise RankFailure(_describe(rank, proc, str(value)))
        if kind != stage:
            raise RankFailure(f"tensor-parallel rank {rank} sent {kind!r} while starting, not {stage!r}")
        values.append(value)
    return values


def _describe(rank: int, proc: Any, message: str | None) -> str:
    code = proc.exitcode
    if code is None:
        how = "stopped answering"
    elif code < 0:
        how = f"was killed by {signal.Signals(-code).name}"
    else:
        how = f"exited with code {code}"
    return f"tensor-parallel rank {rank} (pid {proc.pid}) {how}" + (f": {message}" if message else "")


def _release(procs: list[Any], conns: list[Connection], tp: TPGroup) -> None:
    """SIGKILL and reap the ranks still running, close their pipes and leave the group: what
    ``close`` ends with, and all that is done when a ``RankProcesses`` is collected unclosed."""
    _reap(procs)
    for conn in conns:
        conn.close()
    tp.close()


def _reap(procs: list[Any]) -> None:
    """SIGKILL and reap every rank process still running (the finalizer: also at interpreter exit)."""
    for proc in procs:
        if proc.exitcode is None and proc.pid is not None:
            with contextlib.suppress(OSError, ValueError):
                proc.kill()
    for proc in procs:
        if proc.pid is not None:
            proc.join(timeout=5.0)


# -- the rank process --------------------------------------------------------------------------------


def _watch_parent(parent_pid: int) -> None:
    """Exit this process as soon as its parent (rank 0) is gone: re-parented, ``getppid`` changes."""

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(EXIT_PARENT_GONE)
            time.sleep(PARENT_POLL_S)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def rank_main(rank: int, config: EngineConfig, init_method: str, channel: StepChannel, conn: Connection,
              parent_pid: int) -> None:
    """A rank process: join the group, load the shard, build the runner, then serve steps until
    the shutdown message. Errors go to rank 0 on ``conn`` before the process exits with code 1."""
    _watch_parent(parent_pid)
    for sig in (signal.SIGINT, signal.SIGTERM):  # rank 0 decides when the ranks end (module docstring)
        signal.signal(sig, signal.SIG_IGN)
    tp = None
    try:
        import torch

        from batchinfer.workers.engine.model_runner import ModelRunner
        from batchinfer.workers.models import load_model
        from batchinfer.workers.parallel.group import TPGroup

        conn.send(("hello", os.getpid()))
        parallel = config.parallel
        device = torch.device(parallel.devices[rank])
        if device.type == "cpu":
            torch.set_num_threads(_cpu_threads(parallel.tensor_parallel_size))
        tp = TPGroup.init(rank, parallel.tensor_parallel_size, init_method, _backend(device), device,
                          parallel.tp_timeout_s)
        model = load_model(config.model, config.dtype, device, progress=False, tp=tp)
        conn.send(("loaded", None))
        while not conn.poll(PARENT_POLL_S):  # rank 0's "go": every shard is loaded (the watchdog runs)
            pass
        if conn.recv()[0] != "go":
            raise RuntimeError("rank 0 sent something other than 'go' after the shards loaded")
        wanted = wanted_model_len(config, model.config.max_position_embeddings)
        runner = ModelRunner(model, config, wanted)
        runner.max_model_len = min(wanted, runner.num_blocks * config.block_size)  # as the engine clamps
        conn.send(("ready", runner.num_blocks))
        steps, total_ns, max_ns = 0, 0, 0
        with torch.inference_mode():
            while (step := channel.receive(rank)) is not None:
                runner.run_step(step.host, step.max_seqlen_q, step.max_seqlen_k)
                steps += 1
                total_ns += step.latency_ns
                max_ns = max(max_ns, step.latency_ns)
        conn.send(("stats", {"steps": steps, "mean_us": total_ns / max(1, steps) / 1e3,
                             "max_us": max_ns / 1e3}))
    except BaseException as e:  # noqa: BLE001 - reported to rank 0, then this process ends
        with contextlib.suppress(OSError):
            conn.send(("error", f"{type(e).__name__}: {e}"))
        log.error("tensor-parallel rank %d failed: %s: %s", rank, type(e).__name__, e)
        os._exit(1)  # no atexit handlers: a half-initialised group must not block the exit
    finally:
        if tp is not None:
            tp.close()
