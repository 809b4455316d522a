"""CUDA graphs of decode-only steps: one captured forward per padded batch size.

A decode step of a small model is dominated by kernel launches; replaying a captured graph
launches them all at once. Each graph reads its inputs from static buffers, so a step copies its
tensors in, pads the batch to the captured size (padding rows write nowhere: slot -1) and replays.
The attention backend must be capturable (no host syncs); when capture fails the runner stays
eager and says why once.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from batchinfer.workers.engine.step_scheduler import ScheduledSequence
from batchinfer.workers.models.attention import AttentionMetadata

if TYPE_CHECKING:
    from batchinfer.workers.engine.model_runner import ModelRunner
    from batchinfer.workers.models.decoder import LoRAApply

log = logging.getLogger(__name__)


def batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to ``max_batch_size`` (and it)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch_size] + list(range(16, max_batch_size, 16))
    return sorted({*sizes, max_batch_size})


class DecodeGraphs:
    """Captured decode forwards for each size in ``batch_sizes``; ``run`` replays the smallest fit."""

    def __init__(self, runner: ModelRunner, sizes: list[int]) -> None:
        self.runner = runner
        self.sizes = sizes
        max_bs, dev = max(sizes), runner.device
        max_blocks = -(-runner.max_model_len // runner.block_size)
        self.input_ids = torch.zeros(max_bs, dtype=torch.long, device=dev)  # [B]
        self.positions = torch.zeros(max_bs, dtype=torch.long, device=dev)  # [B]
        self.slot_mapping = torch.full((max_bs,), -1, dtype=torch.long, device=dev)  # [B]
        self.block_tables = torch.zeros(max_bs, max_blocks, dtype=torch.int32, device=dev)  # [B, M]
        self.cu_seqlens_q = torch.arange(max_bs + 1, dtype=torch.int32, device=dev)  # [B + 1]
        self.seq_lens = torch.ones(max_bs, dtype=torch.int32, device=dev)  # [B]
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(sizes):  # the largest first, so the smaller ones reuse its pool
            meta = self._metadata(size)
            args = (self.input_ids[:size], self.positions[:size], runner.kv_caches, meta)
            runner.model(*args)  # warm-up outside capture (allocator, autotuning)
            torch.cuda.synchronize(dev)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = runner.model(*args)  # [size, C]
            self.graphs[size] = (graph, hidden)
        torch.cuda.synchronize(dev)

    @classmethod
    @torch.inference_mode()
    def capture(cls, runner: ModelRunner, max_batch_size: int) -> DecodeGraphs | None:
        """Capture the graphs, or return None (eager) when the model or backend cannot be captured."""
        try:
            return cls(runner, batch_sizes(max_batch_size))
        except Exception as e:  # noqa: BLE001 - any capture failure means "run eagerly"
            log.warning("CUDA graphs disabled, running eagerly: %s: %s", type(e).__name__, e)
            torch.cuda.synchronize(runner.device)
            return None

    def _metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            cu_seqlens_q=self.cu_seqlens_q[:size + 1],
            seq_lens=self.seq_lens[:size],
            max_seqlen_q=1,
            max_seqlen_k=self.runner.max_model_len,
            backend=self.runner.config.attention_backend,
        )

    def can_run(self, scheduled: list[ScheduledSequence], lora: LoRAApply | None = None) -> bool:
        """A decode-only step (one token per sequence) no larger than the largest graph, of the
        base model alone (``lora``: the step's adapters; graphs are captured without any)."""
        return (lora is None and len(scheduled) <= self.sizes[-1]
                and all(s.num_new_tokens == 1 for s in scheduled))

    def run(self, scheduled: list[ScheduledSequence]) -> torch.Tensor:
        """Replay the graph for this step; returns the hidden states of the sampling rows [N, C]."""
        inputs = self.runner.prepare(scheduled)
        n = len(scheduled)
        size = next(s for s in self.sizes if s >= n)
        meta = inputs.attn_metadata
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(inputs.input_ids)
        self.positions[:n].copy_(inputs.positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:size].fill_(-1)  # padding rows write nowhere ...
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.seq_lens[n:size].fill_(1)  # ... and attend to one (ignored) key
        self.block_tables[:n, :width].copy_(meta.block_tables)
        graph, hidden = self.graphs[size]
        graph.replay()
        return hidden[inputs.sample_indices]
