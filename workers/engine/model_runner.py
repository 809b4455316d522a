"""The model runner: owns the KV cache tensors, turns a scheduled step into tensors, runs the model.

A step is flat: the scheduled sequences' new tokens are concatenated (prefill chunks and decode
tokens alike) and described to the attention kernels by ``AttentionMetadata``. Index arrays are
built with numpy over whole steps, not per token in Python; the running sequences' block tables
persist across steps as rows of one array (:class:`BlockTableRows`), so a step copies in only
the blocks added since the last one. On CUDA they reach the device
through page-locked host buffers allocated once (:class:`HostStaging`). Only the hidden states of
sequences that sample this step (their last token) go through the vocabulary projection.

Tensor parallelism: ``model`` is rank 0's shard (``model.tp``) and ``ranks`` the other ranks'
processes. Each rank runs a ``ModelRunner`` of its own over its shard and its own KV cache of
the same number of blocks (the smallest any rank fits, agreed at start). ``execute`` then builds
the step's host arrays once, hands them to the ranks (``StepChannel``) and runs rank 0's shard;
every rank's forward meets in the same collectives. A failure there leaves the ranks out of step:
this and every later step raise ``RankFailure``.

LoRA: with ``lora_stack`` set (by an engine that serves adapters), a step whose sequences hold
adapter slots gets a ``LoRAStep`` (the tokens' slots, grouped once for every layer) as the
forward's ``lora``; steps of the base model alone run as before, CUDA graphs included.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter
from typing import TYPE_CHECKING

import numpy as np
import torch

from batchinfer.workers.engine.sequence import Sequence, SequenceStatus
from batchinfer.workers.engine.step_scheduler import ScheduledSequence
from batchinfer.workers.engine_config import EngineConfig
from batchinfer.workers.lora.stack import LoRAStack, LoRAStep
from batchinfer.workers.models import Decoder
from batchinfer.workers.models.attention import AttentionMetadata

if TYPE_CHECKING:
    from batchinfer.workers.engine.tp_ranks import RankProcesses

log = logging.getLogger(__name__)

# A step's per-sequence fields, read in C (map) rather than by a generator.
_START, _NUM_NEW, _SAMPLES = attrgetter("start"), attrgetter("num_new_tokens"), attrgetter("samples")

# Without a byte budget on CPU: KV for every sequence at full length, but at most this much.
CPU_DEFAULT_KV_BYTES = 2 << 30


@dataclass
class StepInputs:
    """The tensors of one forward pass."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn_metadata: AttentionMetadata
    sample_indices: torch.Tensor  # [N] int64: rows of the hidden states that sample


class ModelRunner:
    """Runs ``model`` over a paged KV cache of ``num_blocks`` blocks it allocates itself."""

    def __init__(self, model: Decoder, config: EngineConfig, max_model_len: int,
                 ranks: RankProcesses | None = None) -> None:
        """``ranks``: the other tensor-parallel ranks, when this runner is rank 0's (``model.tp``)."""
        self.model = model
        self.config = config
        self.device = model.device
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.ranks = ranks
        self.tp = getattr(model, "tp", None)  # TPGroup or None
        self.staging: HostStaging | None = None  # the profiling step (in _num_kv_blocks) pins afresh
        self.num_blocks = self._num_kv_blocks()
        if self.tp is not None and self.tp.size > 1:
            # Every rank's block tables index every rank's cache: the smallest capacity for all.
            self.num_blocks = self.tp.all_reduce_min_int(self.num_blocks)
        if self.device.type == "cuda":
            # Sized for the largest step the scheduler hands out; the CPU path needs no copy at all.
            longest = min(max_model_len, self.num_blocks * self.block_size)
            self.staging = HostStaging(self.device, max_tokens=config.max_num_batched_tokens,
                                       max_seqs=config.max_num_seqs,
                                       max_blocks_per_seq=-(-longest // self.block_size))
        shape = (self.num_blocks, self.block_size, model.num_kv_heads, model.head_dim)
        # [num_blocks, block_size, KVH, D] per layer, K and V apart (the flash-attn paged layout).
        self.kv_caches = [
            (torch.zeros(shape, dtype=model.dtype, device=self.device),
             torch.zeros(shape, dtype=model.dtype, device=self.device))
            for _ in range(model.num_layers)
        ]
        self.lora_stack: LoRAStack | None = None  # set by an engine that serves LoRA adapters
        # Running sequences' block tables, kept across steps (sized on the first step, once the
        # engine has settled max_model_len).
        self.table_rows: BlockTableRows | None = None
        self.graphs = None
        # Under TP no CUDA graphs: a graph replay is decided from the scheduled sequences, which
        # only rank 0 holds, and would need the same decision and NCCL capture on every rank.
        if self.device.type == "cuda" and not config.enforce_eager and not self._parallel:
            from batchinfer.workers.engine.cuda_graph import DecodeGraphs

            self.graphs = DecodeGraphs.capture(self, max_batch_size=config.max_num_seqs)
        if ranks is not None:
            ranks.wait_ready()  # every rank's runner is built: steps may begin

    @property
    def _parallel(self) -> bool:
        return self.tp is not None and self.tp.size > 1

    def close(self) -> None:
        """Shut the other tensor-parallel ranks down (idempotent; nothing to do without TP)."""
        if self.ranks is not None:
            self.ranks.close()

    # -- KV cache sizing ------------------------------------------------------------------------

    @property
    def bytes_per_block(self) -> int:
        return self.model.kv_cache_bytes_per_token() * self.block_size

    def _num_kv_blocks(self) -> int:
        c = self.config
        if c.num_kv_blocks is not None:
            return c.num_kv_blocks
        if c.kv_cache_memory is not None:
            blocks = c.kv_cache_memory // self.bytes_per_block
            if blocks < 1:
                raise ValueError(f"kv_cache_memory {c.kv_cache_memory} bytes is less than one KV block "
                                 f"({self.bytes_per_block} bytes of {self.block_size} tokens)")
            return blocks
        if self.device.type == "cuda":
            return self._profile_cuda_blocks()
        wanted = c.max_num_seqs * self.max_model_len // self.block_size + 1
        return max(1, min(wanted, CPU_DEFAULT_KV_BYTES // self.bytes_per_block))

    @torch.inference_mode()
    def _profile_cuda_blocks(self) -> int:
        """Blocks that fit in ``gpu_memory_utilization`` of the device after a worst-case step.

        The profiling step is ``max_num_batched_tokens`` prefill tokens plus the logits of
        ``max_num_seqs`` rows, over a throw-away cache just big enough for it.
        """
        c = self.config
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        free_before, total = torch.cuda.mem_get_info(self.device)
        tokens = min(c.max_num_batched_tokens, self.max_model_len * c.max_num_seqs)
        seq_len = min(tokens, self.max_model_len)
        lens = [seq_len] * (tokens // seq_len) + ([tokens % seq_len] if tokens % seq_len else [])
        blocks_per_seq = -(-seq_len // self.block_size)
        shape = (blocks_per_seq * len(lens), self.block_size, self.model.num_kv_heads, self.model.head_dim)
        caches = [(torch.empty(shape, dtype=self.model.dtype, device=self.device),
                   torch.empty(shape, dtype=self.model.dtype, device=self.device))
                  for _ in range(self.model.num_layers)]
        tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(len(lens))]
        rows = [(t, 0, n, True) for t, n in zip(tables, lens, strict=True)]
        inputs = self._build(rows, [[0] * n for n in lens])
        hidden = self.model(inputs.input_ids, inputs.positions, caches, inputs.attn_metadata)
        self.model.compute_logits(hidden[:1].expand(c.max_num_seqs, -1))
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        del caches, hidden
        torch.cuda.empty_cache()
        # Memory held outside this process's allocator (other processes, the CUDA context) counts too.
        used_elsewhere = total - free_before - torch.cuda.memory_reserved(self.device)
        budget = int(total * c.gpu_memory_utilization) - used_elsewhere - peak
        blocks = budget // self.bytes_per_block
        if blocks < 1:
            raise ValueError(f"gpu_memory_utilization {c.gpu_memory_utilization} leaves no room for the KV "
                             f"cache (peak step memory {peak / 2**30:.2f} GiB of {total / 2**30:.2f} GiB)")
        log.info("KV cache: %d blocks (%.2f GiB) after a profiling step peaking at %.2f GiB",
                 blocks, blocks * self.bytes_per_block / 2**30, peak / 2**30)
        return blocks

    # -- one step -------------------------------------------------------------------------------

    def prepare(self, scheduled: list[ScheduledSequence], order: np.ndarray | None = None) -> StepInputs:
        """The step's flat tensors: token ids, positions, slots, block tables, sampling rows.

        ``order`` (a permutation of ``scheduled``): the sequences' tokens are laid out in that
        order; the sampling rows still come in ``scheduled``'s."""
        return self._tensors(*self.step_host(scheduled, order))

    def step_host(self, scheduled: list[ScheduledSequence],
                  order: np.ndarray | None = None) -> tuple[dict[str, np.ndarray], int, int]:
        """What ``_host`` builds for ``scheduled`` (the same arrays), from the block-table rows
        kept across steps (:class:`BlockTableRows`) and, in a decode-only step, one token per
        sequence read straight from its token list. Fresh arrays: nothing aliases the rows."""
        if order is not None:
            scheduled = [scheduled[i] for i in order]
        S, bs = len(scheduled), self.block_size
        if self.table_rows is None:
            width = -(-self.max_model_len // bs) + 1
            self.table_rows = BlockTableRows(2 * self.config.max_num_seqs, width)
        rows = self.table_rows.rows([s.seq for s in scheduled])  # [S]
        starts = np.fromiter(map(_START, scheduled), np.int64, S)  # [S]
        nums = np.fromiter(map(_NUM_NEW, scheduled), np.int64, S)  # [S]
        samples = np.fromiter(map(_SAMPLES, scheduled), np.bool_, S)  # [S]
        seq_lens = starts + nums
        T, max_q = int(nums.sum()), int(nums.max())
        if max_q == 1 and T == S:  # decode-only: each sequence runs the one token at its start
            cu = np.arange(S + 1, dtype=np.int64)
            positions = starts
            seq_of_token = np.arange(S)
            ids = np.array([s.seq.token_ids[s.start] for s in scheduled], np.int64)  # [T]
        else:
            cu = np.zeros(S + 1, np.int64)
            np.cumsum(nums, out=cu[1:])
            # As in _host: the token's index in the step, less where its chunk begins in the step,
            # plus where the chunk begins in the sequence.
            positions = np.arange(T, dtype=np.int64) - np.repeat(cu[:-1] - starts, nums)
            seq_of_token = np.repeat(np.arange(S), nums)
            ids = np.fromiter(chain.from_iterable(map(_step_tokens, scheduled)), np.int64, T)
        max_blocks = int(-(-seq_lens.max() // bs))
        tables = self.table_rows.gather(rows, max_blocks)  # [S, M] int32
        slots = tables[seq_of_token, positions // bs].astype(np.int64) * bs + positions % bs  # [T]
        last = cu[1:] - 1  # each sequence's last token in the step
        if order is not None:  # back to the caller's order: row i of the layout is its order[i]
            last[order], samples[order] = last.copy(), samples.copy()
        host = {"input_ids": ids, "positions": positions, "slot_mapping": slots, "block_tables": tables,
                "cu_seqlens_q": cu.astype(np.int32), "seq_lens": seq_lens.astype(np.int32),
                "sample_indices": _sample_indices(last, samples, scheduled, order)}
        return host, max_q, int(seq_lens.max())

    def _build(self, rows: list[tuple[list[int], int, int, bool]], tokens: list[list[int]]) -> StepInputs:
        return self._tensors(*self._host(rows, tokens))

    def _host(self, rows: list[tuple[list[int], int, int, bool]], tokens: list[list[int]],
              order: np.ndarray | None = None) -> tuple[dict[str, np.ndarray], int, int]:
        """The step's host arrays (named as ``HostStaging``'s buffers), max query and key lengths,
        built from scratch (the profiling step; ``step_host``'s reference in the tests).
        ``order``: ``rows`` are in this permutation of the caller's order, whose order the
        sampling rows keep."""
        S, bs = len(rows), self.block_size
        starts = np.fromiter((r[1] for r in rows), np.int64, S)
        nums = np.fromiter((r[2] for r in rows), np.int64, S)
        seq_lens = starts + nums
        cu = np.zeros(S + 1, np.int64)
        np.cumsum(nums, out=cu[1:])
        T = int(cu[-1])
        # Position of every token: its index in the step minus where its sequence's chunk
        # begins in the step, plus where the chunk begins in the sequence.
        positions = np.arange(T, dtype=np.int64) - np.repeat(cu[:-1] - starts, nums)
        max_blocks = int(-(-seq_lens.max() // bs))
        tables = np.zeros((S, max_blocks), np.int32)
        for i, r in enumerate(rows):
            table = r[0]
            tables[i, :len(table)] = table[:max_blocks]
        seq_of_token = np.repeat(np.arange(S), nums)
        slots = tables[seq_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        samples = np.fromiter((r[3] for r in rows), np.bool_, S)
        last = cu[1:] - 1  # each sequence's last token in the step
        if order is not None:  # back to the caller's order: row i of the layout is its order[i]
            last[order], samples[order] = last.copy(), samples.copy()
        sample_indices = last[samples]
        ids = np.fromiter((t for chunk in tokens for t in chunk), np.int64, T)

        host = {"input_ids": ids, "positions": positions, "slot_mapping": slots, "block_tables": tables,
                "cu_seqlens_q": cu.astype(np.int32), "seq_lens": seq_lens.astype(np.int32),
                "sample_indices": sample_indices}
        return host, int(nums.max()), int(seq_lens.max())

    def _tensors(self, host: dict[str, np.ndarray], max_seqlen_q: int, max_seqlen_k: int) -> StepInputs:
        if self.staging is not None:
            t = self.staging.transfer(host)
        else:  # CPU: tensors share the arrays' memory; only the profiling step pins on CUDA
            t = {name: _to(array, self.device) for name, array in host.items()}
        meta = AttentionMetadata(
            slot_mapping=t["slot_mapping"],
            block_tables=t["block_tables"],
            cu_seqlens_q=t["cu_seqlens_q"],
            seq_lens=t["seq_lens"],
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k,
            backend=self.config.attention_backend,
        )
        return StepInputs(t["input_ids"], t["positions"], meta, t["sample_indices"])

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSequence]) -> torch.Tensor:
        """Run one step; returns the float32 logits ``[N, V]`` of the sequences that sample, in order."""
        if self.ranks is not None:
            return self._execute_parallel(scheduled)
        lora, order = None, None
        if self.lora_stack is not None:
            lora, order = self._lora_step(self.lora_stack, scheduled)
        if self.graphs is not None and self.graphs.can_run(scheduled, lora):
            hidden = self.graphs.run(scheduled)
            return self.model.compute_logits(hidden)
        inputs = self.prepare(scheduled, order)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata, lora)
        return self.model.compute_logits(hidden[inputs.sample_indices])  # [N, V]

    def _lora_step(self, stack: LoRAStack,
                   scheduled: list[ScheduledSequence]) -> tuple[LoRAStep | None, np.ndarray | None]:
        """The step's adapters (every token gets its sequence's slot, -1: the base model) and the
        order its sequences are laid out in: by slot, so that each adapter's tokens are one row
        range every projection reads and writes in place (``LoRAMapping.first_row``)."""
        S = len(scheduled)
        seq_slots = np.fromiter((s.seq.lora_slot for s in scheduled), np.int64, S)
        if not (seq_slots >= 0).any():
            return None, None
        order = np.argsort(seq_slots, kind="stable")
        nums = np.fromiter((s.num_new_tokens for s in scheduled), np.int64, S)
        return stack.step(np.repeat(seq_slots[order], nums[order])), order

    def _execute_parallel(self, scheduled: list[ScheduledSequence]) -> torch.Tensor:
        """Rank 0's step under TP: the inputs to the ranks, then rank 0's shard of the forward."""
        assert self.ranks is not None
        try:
            self.ranks.check()  # a rank that died between steps (or an earlier failure): fail now
            host, max_q, max_k = self.step_host(scheduled)
            self.ranks.send(host, max_q, max_k)
            return self.run_step(host, max_q, max_k)
        except Exception as e:
            raise self.ranks.failure(e) from e  # RankFailure; every later step raises one too

    @torch.inference_mode()
    def run_step(self, host: dict[str, np.ndarray], max_seqlen_q: int, max_seqlen_k: int) -> torch.Tensor:
        """This rank's shard of one step from its host arrays: the logits ``[N, V]`` (every rank's)."""
        inputs = self._tensors(host, max_seqlen_q, max_seqlen_k)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata)
        return self.model.compute_logits(hidden[inputs.sample_indices])  # [N, V]


def _step_tokens(s: ScheduledSequence) -> list[int]:
    """The token ids ``s`` runs this step: its owed tokens, then its draft tokens (speculation)."""
    drafts = s.spec_token_ids
    if not drafts:
        return s.seq.token_ids[s.start:s.start + s.num_new_tokens]
    return s.seq.token_ids[s.start:s.start + s.num_new_tokens - len(drafts)] + drafts


def _sample_indices(last: np.ndarray, samples: np.ndarray, scheduled: list[ScheduledSequence],
                    order: np.ndarray | None) -> np.ndarray:
    """The hidden-state rows that go through the vocabulary projection, in the caller's order: each
    sampling sequence's last token and, when it carries k draft tokens, the k + 1 positions ending
    there (one distribution per draft to verify, and the one after them). ``last`` [S] and
    ``samples`` [S] are in the caller's order, ``scheduled`` in the layout's (``order``)."""
    if not any(s.spec_token_ids for s in scheduled):
        return last[samples]
    if order is not None:
        scheduled = [scheduled[i] for i in np.argsort(order)]
    counts = np.fromiter((1 + len(s.spec_token_ids) for s in scheduled), np.int64, len(scheduled))
    counts *= samples  # [S]: rows per sequence, 0 for a prefill chunk that does not sample
    R = int(counts.sum())
    ends = np.repeat(last + 1 - counts, counts)  # [R]: where each sequence's rows begin
    return ends + (np.arange(R, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts))


class BlockTableRows:
    """Sequences' block tables as rows of one int32 array kept across steps: a step gathers its
    sequences' rows (numpy) instead of converting every Python table again.

    A sequence's row is written whole when it first runs and whenever its ``block_table`` is a
    new list (a preemption frees the blocks and starts a new one); otherwise only the blocks
    appended since its last step are copied in (block tables only grow while a sequence holds
    them). When no row is free, the rows of sequences that no longer run are reclaimed; if none
    is, the array doubles. A row holds zeros past its table, as ``_host``'s tables do.
    """

    def __init__(self, num_rows: int, width: int) -> None:
        num_rows, width = max(num_rows, 1), max(width, 1)
        self.array = np.zeros((num_rows, width), np.int32)  # [R, W]
        self._row_of: dict[Sequence, int] = {}
        self._seqs: list[Sequence | None] = [None] * num_rows
        self._tables: list[list[int] | None] = [None] * num_rows  # the list each row copies
        self._lens = [0] * num_rows  # how much of that list the row holds
        self._free = list(range(num_rows - 1, -1, -1))

    def rows(self, seqs: list[Sequence]) -> np.ndarray:
        """The rows holding ``seqs``' block tables as they are now: ``[S]`` int64."""
        row_of, tables, lens = self._row_of, self._tables, self._lens
        out = []
        for seq in seqs:
            table = seq.block_table
            row = row_of.get(seq)
            if row is None or tables[row] is not table or lens[row] > len(table):
                row = self._write(seq, row, seqs)
            elif lens[row] != len(table):  # blocks appended since the last step
                n = lens[row]
                if len(table) > self.array.shape[1]:
                    self._widen(len(table))
                self.array[row, n:len(table)] = table[n:]
                lens[row] = len(table)
            out.append(row)
        return np.array(out, np.int64)

    def gather(self, rows: np.ndarray, width: int) -> np.ndarray:
        """The first ``width`` blocks of ``rows``: ``[S, width]`` int32, a fresh array."""
        if width > self.array.shape[1]:
            self._widen(width)
        return self.array[rows, :width]

    def _write(self, seq: Sequence, row: int | None, step: list[Sequence]) -> int:
        if row is None:
            if not self._free:
                self._reclaim(step)
            row = self._free.pop()
            self._row_of[seq] = row
            self._seqs[row] = seq
        table = seq.block_table
        if len(table) > self.array.shape[1]:
            self._widen(len(table))
        self.array[row] = 0
        self.array[row, :len(table)] = table
        self._tables[row], self._lens[row] = table, len(table)
        return row

    def _reclaim(self, step: list[Sequence]) -> None:
        """Free the rows of sequences not running (finished, or preempted and waiting) and not in
        this ``step``; double the rows when that frees none."""
        in_step = set(step)
        for seq, row in list(self._row_of.items()):
            if seq.status is not SequenceStatus.RUNNING and seq not in in_step:
                del self._row_of[seq]
                self._seqs[row] = self._tables[row] = None
                self._free.append(row)
        if self._free:
            return
        old = self.array.shape[0]
        self.array = np.concatenate([self.array, np.zeros_like(self.array)])
        self._seqs += [None] * old
        self._tables += [None] * old
        self._lens += [0] * old
        self._free = list(range(2 * old - 1, old - 1, -1))

    def _widen(self, width: int) -> None:
        grown = np.zeros((self.array.shape[0], max(width, 2 * self.array.shape[1])), np.int32)
        grown[:, :self.array.shape[1]] = self.array
        self.array = grown


class HostStaging:
    """Page-locked host buffers, allocated once, through which a step's index arrays reach the device.

    Pinning each step's fresh arrays costs a page-locked allocation per array per step. Instead
    ``transfer`` copies them into slices of buffers pinned here once (sized for ``max_tokens``
    tokens over ``max_seqs`` sequences) and copies those to the device without blocking. A buffer
    is written again only after the previous step's copies out of it have finished (an event
    recorded after them is waited on first; by then the step has normally long finished). An array
    larger than its buffer (the scheduler's budget rules it out) is pinned afresh instead.

    On a CPU ``device`` (tests of the slicing) nothing is pinned and the returned tensors are views
    of the buffers; the runner uses this class on CUDA only.
    """

    def __init__(self, device: torch.device, *, max_tokens: int, max_seqs: int,
                 max_blocks_per_seq: int) -> None:
        self.device = device
        cuda = device.type == "cuda"
        sizes = {"input_ids": (max_tokens, torch.int64), "positions": (max_tokens, torch.int64),
                 "slot_mapping": (max_tokens, torch.int64),
                 "block_tables": (max_seqs * max_blocks_per_seq, torch.int32),
                 "cu_seqlens_q": (max_seqs + 1, torch.int32), "seq_lens": (max_seqs, torch.int32),
                 "sample_indices": (max_seqs, torch.int64)}
        self.buffers = {name: torch.empty(n, dtype=dtype, pin_memory=cuda)
                        for name, (n, dtype) in sizes.items()}
        self._copied = torch.cuda.Event() if cuda else None  # recorded after each step's copies

    def transfer(self, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """``arrays`` (named as the buffers, of their dtypes) on the device, each shaped as given."""
        stream = None
        if self._copied is not None:
            stream = torch.cuda.current_stream(self.device)
            self._copied.synchronize()  # never recorded yet: returns at once
        out = {name: self._put(self.buffers[name], array) for name, array in arrays.items()}
        if self._copied is not None:
            self._copied.record(stream)
        return out

    def _put(self, buffer: torch.Tensor, array: np.ndarray) -> torch.Tensor:
        if array.size > buffer.numel():
            return _to(array, self.device)
        host = buffer[:array.size]
        np.copyto(host.numpy(), array.reshape(-1), casting="no")  # casting="no": dtypes must match
        return host.view(array.shape).to(self.device, non_blocking=True)


def _to(array: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(array)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)
