"""``LLM``: the in-process, vLLM-shaped API over one ``Engine``.

    from batchinfer import LLM, SamplingParams
    llm = LLM(model="path/to/model")
    outs = llm.generate(["Hello", {"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=32))
    print(outs[0].outputs[0].text)
    outs = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=32, logprobs=2))
    print(outs[0].outputs[0].logprobs[0])  # {token id: Logprob(logprob, rank, decoded_token), ...}

The progress bar is drawn only when stderr is a terminal unless ``use_tqdm`` says otherwise (the
rule of the CLI's bars, ``batchinfer.ops.progress.show_progress``).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

from tqdm import tqdm

from batchinfer.ops.progress import show_progress
from batchinfer.workers.config import EngineConfig
from batchinfer.workers.engine.engine import Engine
from batchinfer.workers.engine.outputs import RequestOutput
from batchinfer.workers.engine.sequence import Request
from batchinfer.workers.sampling_params import SamplingParams
from batchinfer.workers.text.tokenizer import Tokenizer

Prompt = str | Mapping[str, Any]
Message = Mapping[str, Any]


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
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns one finished ``RequestOutput`` per prompt, in order.

        ``prompts``: strings or ``{"prompt_token_ids": [...]}`` / ``{"prompt": "..."}`` dicts.
        ``sampling_params``: one for all prompts or one per prompt. Every prompt is validated
        before any runs: a bad one raises ``ValueError`` naming the prompt and the field.
        ``use_tqdm``: draw a progress bar on stderr; ``None`` (the default) = when stderr is a terminal.
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

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to chats, as vLLM's ``LLM.chat``: one ``RequestOutput`` per conversation.

        ``messages``: one conversation (a list of ``{"role", "content"}``) or a list of them. Each is
        rendered with the model's chat template (or ``chat_template``), the way the scheduler renders
        ``messages`` bodies, then generated as by :meth:`generate`. ``continue_final_message``
        leaves the last (assistant) message open for the model to continue instead of starting a
        new turn. A conversation that does not render raises ``ValueError`` naming it.
        """
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be set "
                             "(pass add_generation_prompt=False)")
        if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
            raise ValueError("messages: expected a conversation (a list of messages) or a list of them")
        single = isinstance(messages[0], Mapping)
        conversations = [messages] if single else list(messages)
        kwargs = dict(chat_template_kwargs or {})
        if tools is not None:
            kwargs["tools"] = tools
        tokenizer = self.get_tokenizer()
        prompts: list[Prompt] = []
        for i, conversation in enumerate(conversations):
            where = "messages" if single else f"messages[{i}]"
            try:
                text = tokenizer.apply_chat_template(
                    [dict(m) for m in cast("Sequence[Message]", conversation)],
                    add_generation_prompt=add_generation_prompt, chat_template=chat_template, **kwargs)
            except (TypeError, ValueError) as e:
                raise ValueError(f"{where}: {e}") from None
            text = cast(str, text)  # tokenize=False: the rendered text
            if continue_final_message:
                text = _open_final_message(text, conversation, where)
            # The template writes BOS and the other special tokens itself: encode without adding them.
            prompts.append({"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

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

    def _run(self, requests: list[Request], use_tqdm: bool | None) -> list[RequestOutput]:
        pending = {r.request_id for r in requests}
        done: dict[str, RequestOutput] = {}
        draw = show_progress() if use_tqdm is None else use_tqdm
        bar = tqdm(total=len(requests), desc="generating", unit="req", disable=not draw)
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


def _open_final_message(text: str, conversation: Any, where: str) -> str:
    """``text`` cut right after the last message's content (what the template adds after it goes),
    as transformers' ``continue_final_message``."""
    final = conversation[-1].get("content") if conversation else None
    if not isinstance(final, str) or not final.strip():
        raise ValueError(f"{where}: continue_final_message needs a last message with text content")
    at = text.rfind(final.strip())
    if at < 0:
        raise ValueError(f"{where}: the chat template does not write the last message's content verbatim, "
                         "so it cannot be continued")
    return text[: at + len(final.strip())]
