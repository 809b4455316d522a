"""``EmbeddingEngine``: whole sequences in, one pooled vector each out (the ``"embed"`` task).

No KV cache and no chunking: each ``step()`` packs queued inputs, first come first served, up to
``max_num_batched_tokens`` tokens and ``max_num_seqs`` sequences, runs the model once over the
packed tokens (no padding), pools each sequence and keeps its vector. A request may carry several
inputs (an OpenAI ``input`` list) and span steps; it finishes, with one row per input in input
order, when the last of them is pooled. Truncation to ``dimensions`` and normalisation happen
then, in that order (OpenAI's and vLLM's).

The model is chosen from the folder (``workers/models/pooling.py``'s ``embedding_kind``): an
encoder (BERT, RoBERTa, XLM-R; ``workers/models/bert.py``) or a decoder run without its LM head
and without a cache (causal attention over the step's own tokens).
"""

from __future__ import annotations

import json
import logging
from collections import deque
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

from batchinfer.workers.engine.engine import Engine
from batchinfer.workers.engine.interface import ModelFolderState, NoQueueStats, WorkerEngine
from batchinfer.workers.engine.outputs import PooledRequestOutput, StepStats
from batchinfer.workers.engine.processors import check_token_ids, params_of
from batchinfer.workers.engine_config import EngineConfig, resolve_dtype
from batchinfer.workers.models.attention import AttentionMetadata
from batchinfer.workers.models.bert import BertModel, load_encoder
from batchinfer.workers.models.decoder import Decoder
from batchinfer.workers.models.loader import load_model
from batchinfer.workers.models.pooling import (
    PoolingConfig,
    check_supported,
    embedding_kind,
    finish,
    is_embedding_model,
    pool,
)
from batchinfer.workers.pooling_params import PoolingParams
from batchinfer.workers.text.tokenizer import Tokenizer, truncate_text_ids

log = logging.getLogger(__name__)

__all__ = ["EmbeddingEngine", "engine_for", "is_embedding_model"]


@dataclass
class _Request:
    """One embedding request: its inputs, how they are pooled, and the vectors pooled so far."""

    request_id: str
    inputs: list[list[int]]
    pooling_type: str
    normalize: bool
    dimensions: int
    vectors: list[torch.Tensor | None] = field(default_factory=list)  # [C] float32 on the CPU, per input
    remaining: int = 0


class EmbeddingEngine(ModelFolderState, NoQueueStats, WorkerEngine):
    """One embedding model and the requests waiting for it."""

    def __init__(self, config: EngineConfig, model: BertModel | Decoder | None = None,
                 tokenizer: Tokenizer | None = None) -> None:
        """Load ``config.model`` (an embedding folder: see ``is_embedding_model``)."""
        self.config = config
        path = Path(config.model)
        kind = embedding_kind(path)
        if kind is None:
            raise ValueError(f"model {config.model!r} is not an embedding model (config.json names no "
                             "encoder or decoder base class, and there is no sentence-transformers "
                             "modules.json)")
        if config.tensor_parallel_size > 1:  # an embedding model fits one device: run more workers
            raise ValueError(f"tensor_parallel_size {config.tensor_parallel_size}: embedding models run "
                             "on one device; start more workers instead")
        if config.quantization in ("int8", "int4"):  # "auto" settles on none for an embedding model
            raise ValueError(f"quantization {config.quantization!r}: embedding models run dense (the "
                             "quantized linears serve generation's few-row decode steps); give none or "
                             "auto, and dtype bfloat16 for speed")
        if model is None:
            check_supported(path)
            dtype = resolve_dtype(config.dtype)
            model = (load_encoder(path, dtype, config.device) if kind == "encoder"
                     else load_model(path, dtype, config.device, lm_head=False))
        self.model = model
        if isinstance(model, BertModel):
            model.backend = config.attention_backend
            self.embedding_dim, self.vocab_size = model.config.hidden_size, model.config.vocab_size
            model_len, default_pooling = model.config.max_len, "cls"
        else:
            mc = model.config
            self.embedding_dim, self.vocab_size = mc.hidden_size, mc.vocab_size
            model_len, default_pooling = mc.max_position_embeddings, "last"
        model_len = min(model_len, _st_max_seq_length(path) or model_len)
        self.pooling = PoolingConfig.from_dir(path, default_pooling)
        self.matryoshka = self.pooling.matryoshka
        self.tokenizer = tokenizer if tokenizer is not None else Tokenizer.from_dir(path)
        self.model_name = path.name
        self.task = "embed"
        self.eos_token_ids: list[int] = []
        budget = config.max_num_batched_tokens
        if config.max_model_len is not None:
            if config.max_model_len > model_len:
                raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's maximum "
                                 f"input length {model_len}")
            if config.max_model_len > budget:
                raise ValueError(f"max_model_len {config.max_model_len} exceeds max_num_batched_tokens "
                                 f"{budget}: inputs are never split across steps")
        # Whole inputs only: the longest must fit one step.
        self.max_model_len = config.max_model_len or min(model_len, budget)
        self.requests: dict[str, _Request] = {}
        self._queue: deque[tuple[_Request, int]] = deque()  # (request, input index), in arrival order
        self._pending: list[PooledRequestOutput] = []  # aborts, handed out by the next step()
        self.num_steps = 0
        self.num_computed_tokens = 0
        # Always empty: nothing is generated (prompt tokens count from the finished outputs).
        self.step_stats = StepStats()

    @classmethod
    def from_model(cls, model: str | Path, **config: Any) -> EmbeddingEngine:
        """``EmbeddingEngine.from_model(DIR, dtype=..., max_num_batched_tokens=...)``: EngineConfig fields."""
        return cls(EngineConfig(model=str(model), **config))

    # -- requests -------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | None = None,
                    prompt_token_ids: Seq[int] | None = None, sampling_params: Any = None, *,
                    lora: str | None = None, spec_group: str | None = None,
                    inputs: Seq[Seq[int] | str] | None = None,
                    pooling_params: PoolingParams | Mapping[str, Any] | None = None) -> None:
        """Validate and queue one request of ``inputs`` (token-id lists, one vector each; ``prompt``
        or ``prompt_token_ids`` is one input). ``ValueError`` naming the field when it is bad;
        ``spec_group`` is ignored (nothing is decoded)."""
        if lora is not None:
            raise ValueError(f"lora: {self.model_name} is an embedding model; it serves no adapters")
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        if sampling_params is not None:
            raise ValueError("sampling_params: this is an embedding model; give pooling_params instead")
        given = [x is not None for x in (prompt, prompt_token_ids, inputs)]
        if sum(given) != 1:
            raise ValueError("inputs: give exactly one of inputs, prompt and prompt_token_ids")
        if prompt is not None:
            inputs = [prompt]
        elif prompt_token_ids is not None:
            inputs = [prompt_token_ids]
        if not isinstance(inputs, (list, tuple)) or not inputs:
            raise ValueError(f"inputs must be a non-empty list of token-id lists, got {inputs!r:.80}")
        params = params_of(pooling_params, PoolingParams, "pooling_params")
        kind, normalize, dims = self.pooling.resolve(params, self.embedding_dim)
        ids = [self._input_ids(i, x, params.truncate_prompt_tokens) for i, x in enumerate(inputs)]
        req = _Request(request_id, ids, kind, normalize, dims, [None] * len(ids), len(ids))
        self.requests[request_id] = req
        self._queue.extend((req, i) for i in range(len(ids)))

    def _input_ids(self, index: int, value: Any, truncate: int | None) -> list[int]:
        where = f"inputs[{index}]"
        text = value if isinstance(value, str) else None
        if text is not None:
            if not text:
                raise ValueError(f"{where}: the input is an empty string")
            value = self.tokenizer.encode(text)
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{where} must be a list of token ids or a string, got {type(value).__name__}")
        if not value:
            raise ValueError(f"{where}: the input is empty (no tokens)")
        check_token_ids(value, self.vocab_size, where)
        ids = list(value)
        if truncate is not None:
            if truncate > self.max_model_len:
                raise ValueError(f"truncate_prompt_tokens {truncate} exceeds max_model_len "
                                 f"{self.max_model_len}")
            # vLLM: keep the last N tokens (a text keeps the special tokens around it, as the queue does)
            ids = ids[-truncate:] if text is None else truncate_text_ids(self.tokenizer, text, ids, truncate)
        if len(ids) > self.max_model_len:
            raise ValueError(f"{where}: the input has {len(ids)} tokens, more than max_model_len "
                             f"{self.max_model_len} (set truncate_prompt_tokens to keep its last tokens)")
        return ids

    def abort(self, request_id: str) -> None:
        """Drop a request; its final output (no data) comes with the next ``step()``. Unknown ids:
        ignored."""
        req = self.requests.pop(request_id, None)
        if req is not None:
            self._pending.append(PooledRequestOutput(request_id, req.inputs, None, finished=True))

    # -- the step loop --------------------------------------------------------------------------

    def step(self) -> list[PooledRequestOutput]:
        """Pack, run and pool one step; returns the outputs of the requests that finished."""
        outputs, self._pending = self._pending, []
        batch = self._pack()
        if not batch:
            return outputs
        try:
            pooled = self._run([req.inputs[i] for req, i in batch], {req.pooling_type for req, _ in batch})
        except BaseException:
            self._queue.extendleft(reversed(batch))  # nothing was consumed: a retry runs them again
            raise
        for j, (req, i) in enumerate(batch):
            if req.request_id not in self.requests:
                continue  # failed earlier in this loop
            try:
                req.vectors[i] = pooled[req.pooling_type][j]
                req.remaining -= 1
                if req.remaining == 0:
                    rows = cast("list[torch.Tensor]", req.vectors)  # every input is pooled now
                    data = finish(torch.stack(rows), req.dimensions, req.normalize)  # [N, dims]
                    outputs.append(PooledRequestOutput(req.request_id, req.inputs, data.contiguous()))
                    del self.requests[req.request_id]
            except Exception as e:  # noqa: BLE001 - one bad request must not stop the others
                log.exception("embedding request %s failed; aborting it", req.request_id)
                del self.requests[req.request_id]
                outputs.append(PooledRequestOutput(req.request_id, req.inputs, None, True,
                                                   error=f"{type(e).__name__}: {e}"))
        self.num_steps += 1
        return outputs

    def _pack(self) -> list[tuple[_Request, int]]:
        """Queued inputs, first come first served, while the step's token and sequence budgets hold."""
        batch: list[tuple[_Request, int]] = []
        tokens = 0
        while self._queue and len(batch) < self.config.max_num_seqs:
            req, i = self._queue[0]
            if req.request_id not in self.requests or self.requests[req.request_id] is not req:
                self._queue.popleft()  # aborted
                continue
            n = len(req.inputs[i])
            if batch and tokens + n > self.config.max_num_batched_tokens:
                break
            batch.append(self._queue.popleft())
            tokens += n
        return batch

    def _run(self, seqs: list[list[int]], kinds: set[str]) -> dict[str, torch.Tensor]:
        """Model over the packed sequences; {pooling type: [S, C] float32 on the CPU}."""
        device = self.model.device
        lens = torch.tensor([len(s) for s in seqs], dtype=torch.int32)  # [S]
        cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
        torch.cumsum(lens, 0, out=cu[1:])
        T = int(cu[-1])
        ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long)  # [T]
        positions = torch.arange(T) - torch.repeat_interleave(cu[:-1].long(), lens.long())  # [T]
        ids, positions, cu_dev = ids.to(device), positions.to(device), cu.to(device)
        with torch.inference_mode():
            if isinstance(self.model, BertModel):
                hidden = self.model(ids, positions, cu_dev)  # [T, C]
            else:
                longest = int(lens.max())
                meta = AttentionMetadata(
                    slot_mapping=ids.new_empty(0), block_tables=cu_dev.new_empty(0, 0), cu_seqlens_q=cu_dev,
                    seq_lens=lens.to(device), max_seqlen_q=longest, max_seqlen_k=longest,
                    backend=self.config.attention_backend)
                hidden = self.model(ids, positions, None, meta)  # [T, C], final norm applied
            out = {kind: pool(hidden, cu_dev, kind).cpu() for kind in kinds}
        self.num_computed_tokens += T
        return out

    # -- state ----------------------------------------------------------------------------------

    def lora_adapters(self) -> list[str]:
        """Embedding models serve no adapters."""
        return []

    def resident_adapters(self) -> list[str]:
        return []

    def capacity(self) -> dict[str, int]:
        """What this engine accepts; with no KV pool, ``kv_tokens`` is one step's tokens."""
        budget = self.config.max_num_batched_tokens
        return {"max_model_len": self.max_model_len, "max_num_seqs": self.config.max_num_seqs,
                "max_num_batched_tokens": budget, "kv_tokens": budget}




def _st_max_seq_length(path: Path) -> int | None:
    """sentence-transformers' ``max_seq_length`` (sentence_bert_config.json), which caps the input
    length as in vLLM; None when absent."""
    f = path / "sentence_bert_config.json"
    if not f.is_file():
        return None
    try:
        value = json.loads(f.read_text(encoding="utf-8")).get("max_seq_length")
    except (json.JSONDecodeError, AttributeError):
        raise ValueError(f"{f}: expected a JSON object") from None
    return int(value) if isinstance(value, int) and value > 0 else None


def engine_for(config: EngineConfig) -> Engine | EmbeddingEngine:
    """The engine ``config.model`` needs: an :class:`EmbeddingEngine` for an embedding folder (an
    encoder, a decoder base model, sentence-transformers pooling files), else a generation ``Engine``."""
    return EmbeddingEngine(config) if is_embedding_model(config.model) else Engine(config)
