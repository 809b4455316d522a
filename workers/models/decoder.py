"""The one decoder for every architecture in config.py (Llama, Qwen, Gemma ...), over a paged KV cache.

A step is a flat batch of tokens from many sequences (prefill chunks and decode tokens mixed):
no padding, no batch dimension. Attention goes only through the kernels contract
(``write_kv`` then ``paged_attention``); per-step indexing lives in ``AttentionMetadata``.

Parameter layout differs from the checkpoint in two places (the loader fuses them):
``qkv_proj`` = rows of q_proj, k_proj, v_proj stacked; ``gate_up_proj`` = gate_proj then up_proj.

Gemma is the same block with config switches: (1 + w) norms, four norms per layer ("sandwich"),
GeGLU, scaled embeddings, ``query_pre_attn_scalar``, soft-capped attention (a ``paged_attention``
argument) and logits, and for Gemma 3 a second RoPE table that the sliding layers read.

With a ``TPGroup`` of N > 1 ranks the decoder holds its rank's shard (``sharding.py`` has the
split): the modules are built from the rank's ``local_config`` (its heads, intermediate rows,
vocabulary rows), ``o_proj`` / ``down_proj`` / the MoE block end in an all-reduce (their biases
added once, after it), the embedding is a masked lookup + all-reduce and ``compute_logits``
gathers the vocabulary. ``forward`` returns the full hidden states on every rank.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from batchinfer.kernels import paged_attention, varlen_attention
from batchinfer.kernels.fused import rms_norm, rotary_embedding, rotary_embedding_into_cache, silu_and_mul
from batchinfer.workers.models.attention import AttentionMetadata
from batchinfer.workers.models.model_config import ModelConfig
from batchinfer.workers.models.moe import SparseMoeBlock
from batchinfer.workers.models.rope import cos_sin_cache
from batchinfer.workers.models.sharding import ShardPlan
from batchinfer.workers.parallel.group import TPGroup

KVCache = tuple[torch.Tensor, torch.Tensor]  # each [num_blocks, block_size, num_kv_heads, head_dim]


class LoRAApply(Protocol):
    """A step's LoRA adapters (``workers.lora.stack.LoRAStep``): ``apply`` adds each token's
    adapter delta of projection ``group`` of layer ``layer`` to its output ``y`` in place."""

    def apply(self, layer: int, group: str, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor: ...


class LayerLoopFn(Protocol):
    """A compiled layer loop (``workers.quant.layer_loop.LayerLoop``): from the embedded tokens,
    the final hidden states of a step it takes, else None."""

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                 meta: AttentionMetadata) -> torch.Tensor | None: ...


class RMSNorm(nn.Module):
    """Holds the weight; the op is ``kernels.fused.rms_norm`` (optionally fused with a residual add).

    ``unit_offset`` (Gemma): scale by ``1 + weight`` in float32 and cast after, as transformers'
    GemmaRMSNorm does (Llama's norm casts first, then multiplies by the weight in the model dtype).
    """

    def __init__(self, dim: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if not self.unit_offset:
            return rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.float())
        return h.to(x.dtype) if residual is None else (h.to(x.dtype), x)


def row_parallel(linear: nn.Linear, x: torch.Tensor, tp: TPGroup | None) -> torch.Tensor:
    """``linear(x)`` for a row-parallel layer: this rank's partial product summed over the ranks,
    then the (replicated) bias added once. ``tp`` None: plain ``linear(x)``."""
    if tp is None:
        return linear(x)
    y = tp.all_reduce(torch.nn.functional.linear(x, linear.weight))
    return y if linear.bias is None else y.add_(linear.bias)


class Attention(nn.Module):
    """Grouped-query self-attention of one layer (with ``tp``: this rank's heads; ``config`` is local)."""

    def __init__(self, config: ModelConfig, layer: int, tp: TPGroup | None = None):
        super().__init__()
        self.tp = tp
        self.layer = layer
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = (config.query_pre_attn_scalar or self.head_dim) ** -0.5
        self.softcap = config.attn_logit_softcapping
        self.sliding_window = config.layer_sliding_window(layer)
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, config.norm_unit_offset)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, config.norm_unit_offset)

    def forward(
        self,
        x: torch.Tensor,  # [T, C]
        positions: torch.Tensor,  # [T]
        cos_sin: torch.Tensor,  # [max_positions, D]
        kv_cache: KVCache | None,  # None: no cache, meta.cu_seqlens_q delimits whole sequences
        meta: AttentionMetadata,
        lora: LoRAApply | None = None,
    ) -> torch.Tensor:  # [T, C]
        T = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, Q + 2 * KV]
        if lora is not None:
            lora.apply(self.layer, "qkv_proj", qkv, x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(T, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        v = v.view(T, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        if self.q_norm is not None and self.k_norm is not None:  # Qwen3/Gemma 3: per-head norm before RoPE
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(T, self.num_heads, self.head_dim)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(T, self.num_kv_heads, self.head_dim)
        if kv_cache is None:  # no cache (embeddings): whole sequences attend to their own tokens
            q, k = rotary_embedding(positions, q, k, cos_sin)
            o = varlen_attention(q, k, v, meta.cu_seqlens_q, causal=True, scale=self.scale,
                                 sliding_window=self.sliding_window, softcap=self.softcap,
                                 backend=meta.backend)
            return self._out(o.reshape(T, self.q_size), lora)
        k_cache, v_cache = kv_cache
        q, k = rotary_embedding_into_cache(positions, q, k, v, cos_sin, k_cache, v_cache, meta.slot_mapping,
                                           backend=meta.backend)
        o = paged_attention(
            q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.seq_lens,
            scale=self.scale, sliding_window=self.sliding_window, backend=meta.backend, softcap=self.softcap,
        )  # [T, H, D]
        return self._out(o.reshape(T, self.q_size), lora)

    def _out(self, o: torch.Tensor, lora: LoRAApply | None) -> torch.Tensor:  # [T, Q] -> [T, C]
        y = row_parallel(self.o_proj, o, self.tp)
        return y if lora is None else lora.apply(self.layer, "o_proj", y, o)


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))`` with gate and up in one matmul
    (GeGLU with tanh-approximated GELU instead of SiLU for Gemma)."""

    def __init__(self, config: ModelConfig, tp: TPGroup | None = None, layer: int = 0):
        super().__init__()
        self.tp = tp
        self.layer = layer  # the decoder layer's index: the LoRA weights it reads
        inter = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * inter, bias=config.mlp_bias)
        self.down_proj = nn.Linear(inter, config.hidden_size, bias=config.mlp_bias)
        self.gelu_tanh = config.hidden_act == "gelu_pytorch_tanh"

    def forward(self, x: torch.Tensor, lora: LoRAApply | None = None) -> torch.Tensor:  # [T, C] -> [T, C]
        gate_up = self.gate_up_proj(x)  # [T, 2 * I]
        if lora is not None:
            lora.apply(self.layer, "gate_up_proj", gate_up, x)
        if self.gelu_tanh:
            gate, up = gate_up.chunk(2, dim=-1)
            h = torch.nn.functional.gelu(gate, approximate="tanh").mul_(up)
        else:
            h = silu_and_mul(gate_up)  # [T, I]
        y = row_parallel(self.down_proj, h, self.tp)
        return y if lora is None else lora.apply(self.layer, "down_proj", y, h)


class DecoderLayer(nn.Module):
    """Pre-norm block; the residual stream is carried separately so norms can fuse the add."""

    def __init__(self, config: ModelConfig, layer: int, tp: TPGroup | None = None):
        super().__init__()
        norm = (config.hidden_size, config.rms_norm_eps, config.norm_unit_offset)
        self.input_layernorm = RMSNorm(*norm)
        self.self_attn = Attention(config, layer, tp)
        self.post_attention_layernorm = RMSNorm(*norm)
        # Gemma: the post-attention norm acts on the attention output alone; two more wrap the MLP.
        self.pre_feedforward_layernorm = RMSNorm(*norm) if config.sandwich_norms else None
        self.post_feedforward_layernorm = RMSNorm(*norm) if config.sandwich_norms else None
        # MoE: the sparse block in config.moe_layers, a dense MLP elsewhere (Qwen's mlp_only_layers).
        self.mlp: MLP | SparseMoeBlock = (SparseMoeBlock(config, tp) if layer in config.moe_layers
                                          else MLP(config, tp, layer))

    def forward(self, x, residual, positions, cos_sin, kv_cache, meta, lora: LoRAApply | None = None):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, cos_sin, kv_cache, meta, lora)
        if self.pre_feedforward_layernorm is not None and self.post_feedforward_layernorm is not None:
            # Gemma: residual + norm(attn) is fused into the pre-MLP norm; norm(mlp) joins at the next norm.
            x, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(x), residual)
            return self.post_feedforward_layernorm(self._mlp(x, lora)), residual
        x, residual = self.post_attention_layernorm(x, residual)
        return self._mlp(x, lora), residual

    def _mlp(self, x: torch.Tensor, lora: LoRAApply | None) -> torch.Tensor:
        if lora is None or isinstance(self.mlp, SparseMoeBlock):  # MoE experts are no LoRA targets
            return self.mlp(x)
        return self.mlp(x, lora)


class Decoder(nn.Module):
    """Token ids of one step -> final hidden states; ``compute_logits`` maps them to the vocabulary.

    Build it with ``load_model``; a bare ``Decoder(config)`` has uninitialised weights.
    ``tp`` (a group of N > 1 ranks): this rank's shard; ``self.tp`` is then the group, else None.
    ``config`` stays the whole model's; ``self.shard`` (the ``ShardPlan``) has the rank's sizes.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", lm_head: bool = True, tp: TPGroup | None = None):
        super().__init__()
        self.config = config
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.shard = None if self.tp is None else ShardPlan.build(config, self.tp.rank, self.tp.size)
        rank_config = config if self.shard is None else self.shard.local_config()  # the rank's sizes
        # Built on the meta device then allocated uninitialised: no time spent on random init.
        with torch.device("meta"):
            # _weight: skips the random init, whose normal_ on meta imports torch._refs (~2 s).
            self.embed_tokens = nn.Embedding(rank_config.vocab_size, config.hidden_size,
                                             _weight=torch.empty(rank_config.vocab_size, config.hidden_size))
            self.layers = nn.ModuleList(DecoderLayer(rank_config, i, self.tp)
                                        for i in range(config.num_hidden_layers))
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_unit_offset)
            self.lm_head: nn.Module | None = None  # workers/quant may replace it (or set a tied one)
            if lm_head and not config.tie_word_embeddings:  # lm_head=False: an embedder's hidden states only
                self.lm_head = nn.Linear(config.hidden_size, rank_config.vocab_size, bias=False)
        self.to(dtype).to_empty(device=device)
        # Kept float32 (transformers computes angles in float32, then casts cos/sin to the input dtype).
        table = cos_sin_cache(config.max_position_embeddings, config.rotary_dim, config.rope_theta,
                              config.rope_scaling, device=device)
        self.register_buffer("cos_sin_cache", table, persistent=False)
        # Gemma 3: sliding layers rotate with their own base; each layer picks its table.
        local = None
        if config.rope_local_theta is not None:
            local = cos_sin_cache(config.max_position_embeddings, config.rotary_dim, config.rope_local_theta,
                                  config.rope_local_scaling, device=device)
        self.register_buffer("cos_sin_local", local, persistent=False)
        self._local_rope = tuple(local is not None and config.layer_types[i] == "sliding_attention"
                                 for i in range(config.num_hidden_layers))
        # transformers multiplies by sqrt(hidden) rounded to the weights' dtype (a bf16 scalar in bf16).
        self.embed_scale = (float(torch.tensor(config.hidden_size**0.5, dtype=dtype))
                            if config.scale_embeddings else None)
        self.layer_loop: LayerLoopFn | None = None  # CPU decode steps in one call: workers/quant/layer_loop

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        """KV heads this rank's cache holds (all of them without tensor parallelism)."""
        return self.config.num_key_value_heads if self.shard is None else self.shard.kv_heads

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def kv_cache_bytes_per_token(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of K and V cache one token takes across all layers (``dtype`` default: the model's)."""
        itemsize = torch.empty((), dtype=dtype or self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64, position of each token in its sequence
        kv_caches: list[KVCache] | None,  # one (k_cache, v_cache) per layer; None: no cache (embeddings)
        attn_metadata: AttentionMetadata,
        lora: LoRAApply | None = None,  # the step's adapters (None: the base model for every token)
    ) -> torch.Tensor:  # [T, C], final norm applied
        caches: list[KVCache | None] = [None] * self.num_layers if kv_caches is None else list(kv_caches)
        if len(caches) != self.num_layers:
            raise ValueError(f"kv_caches has {len(caches)} entries for {self.num_layers} layers")
        x = self.embed(input_ids)  # [T, C]
        if self.embed_scale is not None:
            x = x * self.embed_scale
        if self.layer_loop is not None and lora is None and kv_caches is not None:
            hidden = self.layer_loop(x, positions, kv_caches, attn_metadata)
            if hidden is not None:
                return hidden
        residual = None
        for i, (layer, kv_cache) in enumerate(zip(self.layers, caches, strict=True)):
            cos_sin = self.cos_sin_local if self._local_rope[i] else self.cos_sin_cache
            x, residual = layer(x, residual, positions, cos_sin, kv_cache, attn_metadata, lora)
        if residual is None:  # no layers
            return self.norm(x)
        x, _ = self.norm(x, residual)
        return x

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, C]
        """Token embeddings; with ``tp`` each rank looks up the ids in its vocabulary rows (zeros
        elsewhere) and an all-reduce assembles them (exact: one non-zero term per element)."""
        if self.shard is None or self.tp is None:
            return self.embed_tokens(input_ids)
        local = input_ids - self.shard.vocab_start
        outside = (local < 0) | (local >= self.shard.vocab)
        x = self.embed_tokens(local.masked_fill(outside, 0))  # [T, C]
        return self.tp.all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0.0))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, C] -> [N, V] float32
        """Vocabulary logits of the selected hidden states (usually each sequence's last token).

        With ``tp`` a collective: every rank computes its vocabulary rows and all get all ``V``."""
        # lm_head: an nn.Linear, or workers/quant's QuantizedLinear (also for a tied head)
        logits = (torch.nn.functional.linear(hidden, self.embed_tokens.weight) if self.lm_head is None
                  else self.lm_head(hidden))  # [N, V / ranks] with tp
        if self.tp is not None:  # rank order = vocabulary order; the last rank's padding is cut
            logits = self.tp.all_gather(logits, dim=-1)  # [N, ranks * ceil(V / ranks)]
            if logits.shape[-1] != self.config.vocab_size:
                logits = logits[:, :self.config.vocab_size].contiguous()
        cap = self.config.final_logit_softcapping
        if cap is not None:  # Gemma: in the model dtype, as transformers does
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
