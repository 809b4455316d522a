"""``LLM``: the in-process, vLLM-shaped API over one ``Engine``.

    from batchinfer import LLM, SamplingParams
    llm = LLM(model="path/to/model")
    outs = llm.generate(["Hello", {"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=32))
    print(outs[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from batchinfer.workers.config import EngineConfig
from batchinfer.workers.engine.engine import Engine
from batchinfer.workers.engine.outputs import RequestOutput
from batchinfer.workers.engine.sequence import Request
from batchinfer.workers.sampling_params import SamplingParams
from batchinfer.workers.text.tokenizer import Tokenizer

Prompt = str | Mapping[str, Any]


class LLM:
    """A model loaded in this process; ``generate`` runs prompts to completion with continuous batching."""

    def __init__(
        self,
        model: str | Path,
        dtype: str = "float32",
        device: str = "cpu",
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 256,
        enable_prefix_caching: bool = True,
        max_model_len: int | None = None,
        **engine_kwargs: Any,
    ) -> None:
        config = EngineConfig(
            model=str(model), dtype=dtype, device=device, block_size=block_size, num_kv_blocks=num_kv_blocks,
            max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
            enable_prefix_caching=enable_prefix_caching, max_model_len=max_model_len, **engine_kwargs,
        )
        self.engine = Engine(config)
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns one finished ``RequestOutput`` per prompt, in order.

        ``prompts``: strings or ``{"prompt_token_ids": [...]}`` / ``{"prompt": "..."}`` dicts.
        ``sampling_params``: one for all prompts or one per prompt. Every prompt is validated
        before any runs: a bad one raises ``ValueError`` naming the prompt and the field.
        """
        if isinstance(prompts, (str, Mapping)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts "
                                 "(give one for all, or one per prompt)")
        requests = [self._request(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
        for req in requests:
            self.engine.enqueue(req)
        return self._run(requests, use_tqdm)

    def _request(self, index: int, prompt: Prompt, params: SamplingParams) -> Request:
        if isinstance(prompt, str):
            kwargs: dict[str, Any] = {"prompt": prompt}
        elif isinstance(prompt, Mapping):
            unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
            if unknown:
                raise ValueError(f"prompts[{index}]: unknown key {unknown[0]!r} "
                                 "(a prompt is a string, {'prompt': ...} or {'prompt_token_ids': [...]})")
            kwargs = {"prompt": prompt.get("prompt"), "prompt_token_ids": prompt.get("prompt_token_ids")}
        else:
            raise ValueError(f"prompts[{index}] must be a string or a dict, got {type(prompt).__name__}")
        try:
            return self.engine.make_request(str(next(self._ids)), sampling_params=params, **kwargs)
        except ValueError as e:
            raise ValueError(f"prompts[{index}]: {e}") from None

    def _run(self, requests: list[Request], use_tqdm: bool) -> list[RequestOutput]:
        pending = {r.request_id for r in requests}
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(requests), desc="generating", unit="req", disable=not use_tqdm)
        try:
            while pending:
                for out in self.engine.step():
                    if out.finished and out.request_id in pending:
                        done[out.request_id] = out
                        pending.discard(out.request_id)
                        bar.update(1)
        except BaseException:
            for rid in pending:  # an interrupted generate leaves no work behind in the engine
                self.engine.abort(rid)
            raise
        finally:
            bar.close()
        return [done[r.request_id] for r in requests]
