"""How a ``Decoder`` is split across the ranks of a tensor-parallel group (Megatron-LM's layout).

- Attention: q heads split evenly (rank r holds heads ``[r*H/N, (r+1)*H/N)``); q/k/v are
  column-parallel (each rank computes its heads), ``o_proj`` row-parallel (each rank multiplies
  its heads' columns, then one all-reduce sums the partial outputs; its bias is added once, after).
  KV heads split the same way when N divides them; with fewer KV heads than ranks each KV head is
  replicated: rank r holds KV head ``r * KVH // N`` (which is the one its q heads read).
- MLP: ``gate_up`` column-parallel (rank r holds rows ``[r*I/N, (r+1)*I/N)`` of gate and of up),
  ``down`` row-parallel + all-reduce, bias added once after it.
- MoE: every rank holds every expert, each expert's intermediate split as the MLP's (``w13``
  rows, ``w2`` columns), the router replicated; the routed output, plus Qwen2-MoE's shared expert
  (split the same way; its scalar sigmoid gate replicated), is one all-reduce. Splitting each
  expert keeps the load even whatever the routing picks (experts split across ranks would leave
  ranks idle on skewed batches).
- Embedding and LM head: vocabulary-parallel, ``ceil(V/N)`` rows per rank (the last rank's
  padded with zero rows; a vocabulary N does not divide needs no refusal). The embedding is a
  masked lookup + all-reduce; the logits are gathered along the vocabulary and the padding cut.
- Norms (and q/k norms) replicated: every rank holds the full hidden states between layers.

``ShardPlan`` gives each rank's sizes (``local_config``: the config the rank's modules are built
from) and, for each parameter a checkpoint tensor fills, the rows or columns of that tensor the
rank reads (``source``): the loader reads only those from safetensors (``get_slice``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from batchinfer.workers.models.model_config import ModelConfig


@dataclass(frozen=True)
class SourceSlice:
    """The part of a checkpoint tensor one rank reads: ``ranges`` of indices along ``dim``,
    concatenated, then zero-padded along ``dim`` to ``pad_to`` (None: no padding).

    ``full`` is the checkpoint tensor's size along ``dim`` that config.json implies (checked).
    """

    dim: int
    ranges: tuple[tuple[int, int], ...]
    full: int
    pad_to: int | None = None


@dataclass(frozen=True)
class ShardPlan:
    """Rank ``rank`` of ``size``: which heads, KV heads, intermediate rows and vocabulary rows it holds."""

    rank: int
    size: int
    heads: int  # q heads per rank
    kv_heads: int  # KV heads this rank holds (1 when they are replicated)
    kv_head_start: int  # the first of them
    inter: int  # dense MLP intermediate per rank
    moe_inter: int  # each routed expert's intermediate per rank
    shared_inter: int  # the shared expert's intermediate per rank
    vocab: int  # embedding / LM head rows per rank (padded)
    config: ModelConfig

    @classmethod
    def build(cls, config: ModelConfig, rank: int, size: int) -> ShardPlan:
        """The plan of ``rank``; ``ValueError`` naming the field when ``size`` cannot split ``config``."""
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"rank {rank} of tensor parallel size {size} is not a valid rank")
        heads, kv = config.num_attention_heads, config.num_key_value_heads

        def need(value: int, field: str, why: str = "") -> None:
            if value % size:
                raise ValueError(f"tensor parallel size {size} does not divide {field} {value} of "
                                 f"{config.architecture}{why}; choose a size that divides it")

        need(heads, "num_attention_heads")
        if kv >= size:
            need(kv, "num_key_value_heads")
            kv_heads, kv_start = kv // size, rank * (kv // size)
        else:
            if size % kv:
                raise ValueError(f"tensor parallel size {size} is not a multiple of num_key_value_heads "
                                 f"{kv} of {config.architecture} (with fewer KV heads than ranks each "
                                 "KV head is replicated on size / num_key_value_heads ranks)")
            kv_heads, kv_start = 1, rank * kv // size
        dense = [i for i in range(config.num_hidden_layers) if i not in config.moe_layers]
        if dense:
            need(config.intermediate_size, "intermediate_size")
        if config.moe_layers:
            need(config.moe_intermediate_size, "the experts' intermediate size (moe_intermediate_size)")
            if config.shared_expert_intermediate_size:
                need(config.shared_expert_intermediate_size, "shared_expert_intermediate_size")
        return cls(rank=rank, size=size, heads=heads // size, kv_heads=kv_heads, kv_head_start=kv_start,
                   inter=config.intermediate_size // size if dense else config.intermediate_size,
                   moe_inter=config.moe_intermediate_size // size,
                   shared_inter=config.shared_expert_intermediate_size // size,
                   vocab=-(-config.vocab_size // size), config=config)

    def local_config(self) -> ModelConfig:
        """The config this rank's modules are built from (its heads, intermediate and vocabulary)."""
        return dataclasses.replace(
            self.config, num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
            intermediate_size=self.inter, moe_intermediate_size=self.moe_inter,
            shared_expert_intermediate_size=self.shared_inter, vocab_size=self.vocab)

    @property
    def vocab_start(self) -> int:
        """The first vocabulary row this rank holds."""
        return self.rank * self.vocab

    def source(self, pname: str, part: str | None) -> SourceSlice | None:
        """What this rank reads of the checkpoint tensor filling ``part`` of parameter ``pname``
        (our name, e.g. ``layers.3.self_attn.qkv_proj.weight``); None = the whole tensor (replicated).

        ``part`` is the loader's: ``q``/``k``/``v``, ``gate``/``up``, ``"<expert>.gate|up|down"``,
        or None for a parameter filled by one tensor (Phi-3's fused ``qkv_proj`` / ``gate_up_proj``
        are None too: their rank's rows are gathered from each of the fused parts).
        """
        c, D = self.config, self.config.head_dim
        name = pname.split(".", 2)[-1] if pname.startswith("layers.") else pname
        if name in ("embed_tokens.weight", "lm_head.weight"):
            start = self.vocab_start
            return SourceSlice(0, ((min(start, c.vocab_size), min(start + self.vocab, c.vocab_size)),),
                               c.vocab_size, pad_to=self.vocab)
        if name in ("self_attn.qkv_proj.weight", "self_attn.qkv_proj.bias"):
            q_full, kv_full = c.num_attention_heads * D, c.num_key_value_heads * D
            q = (self.rank * self.heads * D, (self.rank + 1) * self.heads * D)
            kv = (self.kv_head_start * D, (self.kv_head_start + self.kv_heads) * D)
            if part == "q":
                return SourceSlice(0, (q,), q_full)
            if part in ("k", "v"):
                return SourceSlice(0, (kv,), kv_full)
            return SourceSlice(0, (q, _shift(kv, q_full), _shift(kv, q_full + kv_full)), q_full + 2 * kv_full)
        if name == "self_attn.o_proj.weight":
            return SourceSlice(1, (_block(self.rank, self.heads * D),), c.num_attention_heads * D)
        if name in ("mlp.gate_up_proj.weight", "mlp.gate_up_proj.bias"):
            return _gate_up(self.rank, self.inter, c.intermediate_size, part)
        if name == "mlp.down_proj.weight":
            return SourceSlice(1, (_block(self.rank, self.inter),), c.intermediate_size)
        if name == "mlp.shared_expert.gate_up_proj.weight":
            return _gate_up(self.rank, self.shared_inter, c.shared_expert_intermediate_size, part)
        if name == "mlp.shared_expert.down_proj.weight":
            return SourceSlice(1, (_block(self.rank, self.shared_inter),), c.shared_expert_intermediate_size)
        if name == "mlp.w13":  # one expert's gate_proj / up_proj: [I, C] -> its rank's rows
            return SourceSlice(0, (_block(self.rank, self.moe_inter),), c.moe_intermediate_size)
        if name == "mlp.w2":  # one expert's down_proj: [C, I] -> its rank's columns
            return SourceSlice(1, (_block(self.rank, self.moe_inter),), c.moe_intermediate_size)
        return None  # norms, the router, row-parallel biases, q/k norms: every rank reads it whole


def _block(rank: int, n: int) -> tuple[int, int]:
    return rank * n, (rank + 1) * n


def _shift(r: tuple[int, int], by: int) -> tuple[int, int]:
    return r[0] + by, r[1] + by


def _gate_up(rank: int, local: int, full: int, part: str | None) -> SourceSlice:
    rows = _block(rank, local)
    if part in ("gate", "up"):
        return SourceSlice(0, (rows,), full)
    return SourceSlice(0, (rows, _shift(rows, full)), 2 * full)  # a fused gate_up checkpoint tensor
