"""``LLM``: the in-process, vLLM-shaped API over one ``Engine``.

    from batchinfer import LLM, SamplingParams
    llm = LLM(model="path/to/model")  # a folder, a .gguf file, or demo, tiny, minilm as `run --model`
    outs = llm.generate(["Hello", {"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=32))
    print(outs[0].outputs[0].text)
    outs = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=32, logprobs=2))
    print(outs[0].outputs[0].logprobs[0])  # {token id: Logprob(logprob, rank, decoded_token), ...}

    llm = LLM(model="path/to/model", enable_lora=True, max_loras=4)   # PEFT adapters per prompt
    outs = llm.generate(prompts, params, lora_request=LoRARequest("sql", 1, "path/to/adapter"))

The progress bar is drawn only when stderr is a terminal unless ``use_tqdm`` says otherwise (the
rule of the CLI's bars, ``batchinfer.workers.progress.show_progress``).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

from tqdm import tqdm

from batchinfer.workers.engine.embedder import EmbeddingEngine, engine_for
from batchinfer.workers.engine.engine import Engine
from batchinfer.workers.engine.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from batchinfer.workers.engine.sequence import Request
from batchinfer.workers.engine_config import EngineConfig
from batchinfer.workers.lora_request import LoRARequest
from batchinfer.workers.models.demo import NAMES, resolve_model
from batchinfer.workers.pooling_params import PoolingParams
from batchinfer.workers.progress import show_progress
from batchinfer.workers.sampling_params import SamplingParams
from batchinfer.workers.structured_params import StructuredOutputsParams
from batchinfer.workers.text.tokenizer import Tokenizer, truncate_text_ids
from batchinfer.workers.tools import (
    NEEDS_SPECIAL_TOKENS,
    TOOL_PARSERS,
    ToolParserMissing,
    ToolSpec,
    extract_tool_calls,
    finish_reason_with_tools,
    parse_tools,
    parser_for_template,
    template_messages,
)

Prompt = str | Mapping[str, Any]
P = TypeVar("P", SamplingParams, PoolingParams)  # per-prompt parameters
# What LLM.embed takes per prompt: text, token ids, or {"prompt": ...} / {"prompt_token_ids": [...]}.
EmbedPrompt = str | Sequence[int] | Mapping[str, Any]
Message = Mapping[str, Any]


class LLM:
    """A model loaded in this process; ``generate`` runs prompts to completion with continuous batching.

    An embedding model folder (``is_embedding_model``: BERT-family encoders, decoder base models,
    sentence-transformers folders) gets an ``EmbeddingEngine`` instead, and ``embed`` instead of
    ``generate`` / ``chat``.
    """

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
        tensor_parallel_size: int = 1,
        quantization: str = "none",
        **engine_kwargs: Any,
    ) -> None:
        """``tensor_parallel_size`` N > 1: the model split over N processes (this one is rank 0),
        ``device`` "cpu" (gloo), "cuda" (cuda:0 .. cuda:N-1) or a list "cuda:0,cuda:2"; ``close()``
        ends them and leaves the torch.distributed group; an ``LLM`` deleted unclosed does both when
        it is collected (``del llm`` and a new TP ``LLM`` in the same process works), else they end
        with this process. ``engine_kwargs`` are ``EngineConfig``'s other fields, e.g.
        ``speculative_config={"method": "ngram", "num_speculative_tokens": 4}`` (vLLM's dict, its
        JSON text or a ``SpeculativeConfig``): speculative decoding, which changes no output.
        ``quantization`` "int8" / "int4" / "auto": weight-only quantized linears on the CPU, run in
        bfloat16 (``EngineConfig.quantization``; docs/engine.md, Quantized and bfloat16 weights)."""
        if str(model) in NAMES:  # demo, tiny, minilm: the checkpoints `batchinfer run --model` names
            model = resolve_model(model)[0]
        config = EngineConfig(
            model=str(model), dtype=dtype, device=device, block_size=block_size, num_kv_blocks=num_kv_blocks,
            max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
            enable_prefix_caching=enable_prefix_caching, max_model_len=max_model_len,
            tensor_parallel_size=tensor_parallel_size, quantization=quantization, **engine_kwargs,
        )
        self.engine: Engine | EmbeddingEngine = engine_for(config)
        self._ids = itertools.count()

    @property
    def task(self) -> str:
        """``"generate"`` or ``"embed"``: which of ``generate`` / ``embed`` this model supports."""
        return self.engine.task

    def close(self) -> None:
        """Shut down the engine's tensor-parallel rank processes (idempotent; nothing to do without TP)."""
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()

    def _generator(self, method: str) -> Engine:
        if not isinstance(self.engine, Engine):
            raise ValueError(f"LLM.{method}() is only supported for generative models; "
                             f"{self.engine.model_name} is an embedding model (use LLM.embed())")
        return self.engine

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns one finished ``RequestOutput`` per prompt, in order.

        ``prompts``: strings or ``{"prompt_token_ids": [...]}`` / ``{"prompt": "..."}`` dicts.
        ``sampling_params``: one for all prompts or one per prompt. Every prompt is validated
        before any runs: a bad one raises ``ValueError`` naming the prompt and the field.
        ``use_tqdm``: draw a progress bar on stderr; ``None`` (the default) = when stderr is a terminal.
        ``lora_request``: the LoRA adapter of every prompt, or one per prompt (None: the base model);
        the engine needs ``enable_lora=True`` (or ``lora_modules``). An adapter is loaded and checked
        on its first use: one it cannot serve raises ``ValueError`` before anything runs.
        """
        engine = self._generator("generate")
        if isinstance(prompts, (str, Mapping)):
            prompts = [prompts]
        prompts = list(prompts)
        # Only finished outputs are read here: the engine builds no per-step ones (final_only).
        params = _final_only(_per_prompt(sampling_params, SamplingParams, len(prompts), "sampling_params"))
        loras = _loras_per_prompt(lora_request, len(prompts))
        requests = [self._request(i, p, sp, lr)
                    for i, (p, sp, lr) in enumerate(zip(prompts, params, loras, strict=True))]
        for req in requests:
            engine.enqueue(req)
        return self._run(requests, use_tqdm)

    def embed(
        self,
        prompts: EmbedPrompt | Sequence[EmbedPrompt],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One vector per prompt, as vLLM's ``LLM.embed``: ``outs[i].outputs.embedding`` (a list of floats).

        ``prompts``: a string, a list of token ids, ``{"prompt_token_ids": [...]}`` / ``{"prompt": ...}``,
        or a list of these. ``pooling_params``: one for all prompts or one per prompt (``None``: the
        model's pooling, normalisation and full width). ``truncate_prompt_tokens`` (vLLM's argument)
        keeps each prompt's last N tokens. Every prompt is validated before any runs: a bad one
        raises ``ValueError`` naming it. On a generation model: ``ValueError``.
        """
        engine = self.engine
        if not isinstance(engine, EmbeddingEngine):
            raise ValueError(f"LLM.embed() is only supported for embedding models; {engine.model_name} "
                             "is a generative model (use LLM.generate())")
        if isinstance(prompts, (str, Mapping)) or (
                isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            prompts = [cast(EmbedPrompt, prompts)]
        prompts = list(cast("Sequence[EmbedPrompt]", prompts))
        params = _per_prompt(pooling_params, PoolingParams, len(prompts), "pooling_params")
        if truncate_prompt_tokens is not None:
            params = [PoolingParams(**{**p.to_dict(), "truncate_prompt_tokens": truncate_prompt_tokens})
                      for p in params]
        inputs, texts = self._embed_inputs(prompts, engine.tokenizer)
        for i, text in texts.items():  # a text keeps its special tokens around its last ones
            keep = params[i].truncate_prompt_tokens
            if keep is not None and len(inputs[i]) > keep:
                inputs[i] = truncate_text_ids(engine.tokenizer, text, inputs[i], keep)
        ids = [f"embd-{next(self._ids)}" for _ in inputs]
        # Longest first, as sentence-transformers sorts: each step then packs sequences of similar
        # lengths, which the attention backends batch best. Results come back in prompt order.
        order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i]))
        added: list[str] = []
        try:
            for i in order:
                try:
                    engine.add_request(ids[i], inputs=[inputs[i]], pooling_params=params[i])
                except ValueError as e:
                    raise ValueError(f"prompts[{i}]: {e}") from None
                added.append(ids[i])
        except BaseException:
            for rid in added:  # validation failed part-way: leave nothing queued
                engine.abort(rid)
            engine.step()  # hands out (and drops) the aborts' outputs
            raise
        done = self._drain(ids, use_tqdm, "embedding")
        failed = next((done[rid] for rid in ids if done[rid].error), None)
        if failed is not None:
            raise RuntimeError(f"prompts[{ids.index(failed.request_id)}]: {failed.error}")
        return [EmbeddingRequestOutput(rid, EmbeddingOutput(done[rid].data[0].tolist()),
                                       done[rid].prompt_token_ids[0]) for rid in ids]

    @staticmethod
    def _embed_inputs(prompts: list[EmbedPrompt],
                      tokenizer: Tokenizer) -> tuple[list[list[int]], dict[int, str]]:
        """Token ids per prompt, and the texts by prompt index: texts encoded together (in
        parallel inside the tokenizers library)."""
        out: list[Any] = []
        texts: dict[int, str] = {}
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, Mapping):
                unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
                if unknown or len(prompt) != 1:
                    raise ValueError(f"prompts[{i}]: a prompt is a string, a list of token ids, "
                                     "{'prompt': ...} or {'prompt_token_ids': [...]}")
                prompt = prompt.get("prompt", prompt.get("prompt_token_ids"))
            if isinstance(prompt, str):
                if not prompt:
                    raise ValueError(f"prompts[{i}]: the prompt is an empty string")
                texts[i] = prompt
            elif not isinstance(prompt, Sequence):
                raise ValueError(f"prompts[{i}] must be a string or a list of token ids, "
                                 f"got {type(prompt).__name__}")
            out.append(prompt if isinstance(prompt, str) else list(prompt))
        for i, ids in zip(texts, tokenizer.encode_batch(list(texts.values())), strict=True):
            out[i] = ids
        return out, texts

    def _drain(self, request_ids: list[str], use_tqdm: bool | None, desc: str) -> dict[str, Any]:
        """Step the engine until every request in ``request_ids`` finished; their final outputs by id."""
        pending = set(request_ids)
        done: dict[str, Any] = {}
        draw = show_progress() if use_tqdm is None else use_tqdm
        bar = tqdm(total=len(request_ids), desc=desc, unit="req", disable=not draw)
        try:
            while pending:
                for out in self.engine.step():
                    if out.finished and out.request_id in pending:
                        done[out.request_id] = out
                        pending.discard(out.request_id)
                        bar.update(1)
        except BaseException:
            for rid in pending:  # an interrupted call leaves no work behind in the engine
                self.engine.abort(rid)
            raise
        finally:
            bar.close()
        return done

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
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        *,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        tool_call_parser: str | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to chats, as vLLM's ``LLM.chat``: one ``RequestOutput`` per conversation.

        ``messages``: one conversation (a list of ``{"role", "content"}``) or a list of them. Each is
        rendered with the model's chat template (or ``chat_template``), the way the scheduler renders
        ``messages`` bodies, then generated as by :meth:`generate`. ``continue_final_message``
        leaves the last (assistant) message open for the model to continue instead of starting a
        new turn. A conversation that does not render raises ``ValueError`` naming it.
        ``lora_request``: as :meth:`generate`'s, per conversation.

        Tools (docs/tool_calling.md): ``tools`` (OpenAI function tools), ``tool_choice`` and
        ``parallel_tool_calls`` as in a chat body, checked by the same rules; the template gets the
        tools. ``"required"`` and a named function constrain the output to calls whose arguments
        match the functions' ``parameters`` (a ``sampling_params`` with its own
        ``structured_outputs`` is a ``ValueError``); ``"auto"`` reads calls in the format of
        ``tool_call_parser`` (one of ``TOOL_PARSERS``; default: the chat template's, and
        ``ToolParserMissing`` when it names none). Each completion then has ``tool_calls`` (OpenAI's
        shape), ``text`` the content outside them and ``finish_reason`` ``"tool_calls"`` when calls
        were made. Without ``tool_choice`` the choice is ``"auto"``, and when no parser is known the
        text is left as it is (vLLM's ``LLM.chat`` only renders the tools).
        """
        self._generator("chat")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be set "
                             "(pass add_generation_prompt=False)")
        if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
            raise ValueError("messages: expected a conversation (a list of messages) or a list of them")
        single = isinstance(messages[0], Mapping)
        conversations = [messages] if single else list(messages)
        kwargs = dict(chat_template_kwargs or {})
        spec = parse_tools(tools, dict(tool_choice) if isinstance(tool_choice, Mapping) else tool_choice,
                           parallel_tool_calls)
        if spec is not None:
            kwargs["tools"] = spec.template_tools()
        tokenizer = self.get_tokenizer()
        parser = _tool_parser(spec, tool_choice, tool_call_parser, chat_template or tokenizer.chat_template)
        prompts: list[Prompt] = []
        for i, conversation in enumerate(conversations):
            where = "messages" if single else f"messages[{i}]"
            try:
                text = tokenizer.apply_chat_template(
                    template_messages([dict(m) for m in cast("Sequence[Message]", conversation)]),
                    add_generation_prompt=add_generation_prompt, chat_template=chat_template, **kwargs)
            except (TypeError, ValueError) as e:
                raise ValueError(f"{where}: {e}") from None
            text = cast(str, text)  # tokenize=False: the rendered text
            if continue_final_message:
                text = _open_final_message(text, conversation, where)
            # The template writes BOS and the other special tokens itself: encode without adding them.
            prompts.append({"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        params = _with_call_schema(sampling_params, spec, len(prompts), parser)
        outputs = self.generate(prompts, params, use_tqdm=use_tqdm, lora_request=lora_request)
        if spec is not None and (spec.choice != "auto" or parser is not None):
            for out in outputs:
                _set_tool_calls(out, spec, parser)
        return outputs

    def _request(self, index: int, prompt: Prompt, params: SamplingParams,
                 lora: LoRARequest | None = None) -> Request:
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
            engine = self._generator("generate")
            if lora is not None:
                kwargs["lora"] = lora
            return engine.make_request(str(next(self._ids)), sampling_params=params, **kwargs)
        except ValueError as e:
            raise ValueError(f"prompts[{index}]: {e}") from None

    def _run(self, requests: list[Request], use_tqdm: bool | None) -> list[RequestOutput]:
        done = self._drain([r.request_id for r in requests], use_tqdm, "generating")
        return [done[r.request_id] for r in requests]


def _tool_parser(spec: ToolSpec | None, tool_choice: Any, given: str | None,
                 template: str | None) -> str | None:
    """The parser of ``auto`` calls: ``given`` (checked), else the template's. An explicit
    ``tool_choice="auto"`` with neither raises ``ToolParserMissing`` before anything runs."""
    if given is not None and given not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser: must be one of {', '.join(TOOL_PARSERS)}, got {given!r}")
    if spec is None or spec.choice != "auto":
        return given
    parser = given or parser_for_template(template)
    if parser is None and tool_choice is not None:
        raise ToolParserMissing(
            "tool_call_parser: tool_choice 'auto' needs a parser for this model's tool-call format and "
            f"its chat template names none: pass tool_call_parser=NAME (one of {', '.join(TOOL_PARSERS)}), "
            "or tool_choice 'required' or a named function")
    return parser


def _with_call_schema(given: SamplingParams | Sequence[SamplingParams] | None, spec: ToolSpec | None,
                      n: int, parser: str | None) -> SamplingParams | Sequence[SamplingParams] | None:
    """``given`` constrained to ``spec``'s call list for ``required`` / a named function (for
    ``auto`` with a special-token parser: decoded keeping special tokens)."""
    forced = spec.call_constraint() if spec is not None else None
    if spec is not None and spec.choice == "auto" and parser in NEEDS_SPECIAL_TOKENS:
        # the parser reads its format's special tokens ([TOOL_CALLS], [ARGS]): keep them in the text
        return [dataclasses.replace(p, skip_special_tokens=False)
                for p in _per_prompt(given, SamplingParams, n, "sampling_params")]
    if spec is None or forced is None:
        return given
    params = _per_prompt(given, SamplingParams, n, "sampling_params")
    if any(p.structured_outputs is not None for p in params):
        raise ValueError(f"sampling_params.structured_outputs: tool_choice {spec.choice!r} constrains the "
                         "output to the tool calls already; give one or the other")
    constraint = StructuredOutputsParams.from_dict(forced)
    return [dataclasses.replace(p, structured_outputs=constraint) for p in params]


def _set_tool_calls(output: RequestOutput, spec: ToolSpec, parser: str | None) -> None:
    """Each completion's text split into its content and its ``tool_calls`` (as a worker's rows)."""
    for completion in output.outputs:
        found = extract_tool_calls(completion.text, spec, parser, f"{output.request_id}:{completion.index}")
        completion.text = found.content or ""
        completion.tool_calls = found.tool_calls
        completion.finish_reason = finish_reason_with_tools(completion.finish_reason, found.tool_calls)


def _per_prompt(given: P | Sequence[P] | None, kind: type[P], n: int, name: str) -> list[P]:
    """One ``kind`` per prompt from ``given``: None (the default for all), one for all, or one per
    prompt (``ValueError`` naming ``name`` when the count differs)."""
    if given is None or isinstance(given, kind):
        return [given or kind()] * n
    per_prompt = list(cast("Sequence[P]", given))  # isinstance with type[P] does not narrow for mypy
    if len(per_prompt) != n:
        raise ValueError(f"{name}: {len(per_prompt)} given for {n} prompts "
                         "(give one for all, or one per prompt)")
    return per_prompt


def _final_only(params: list[SamplingParams]) -> list[SamplingParams]:
    """``params`` with ``output_kind="final_only"`` (one copy per distinct object; anything not a
    ``SamplingParams`` or a dict is left for ``make_request`` to reject as before)."""
    copies: dict[int, Any] = {}
    out: list[Any] = []
    for p in params:
        if id(p) not in copies:
            if isinstance(p, SamplingParams):
                copies[id(p)] = dataclasses.replace(p, output_kind="final_only")
            elif isinstance(p, Mapping):
                copies[id(p)] = {**p, "output_kind": "final_only"}
            else:
                copies[id(p)] = p
        out.append(copies[id(p)])
    return out


def _loras_per_prompt(given: LoRARequest | Sequence[LoRARequest | None] | None,
                      n: int) -> list[LoRARequest | None]:
    """One adapter (or None) per prompt: None or one ``LoRARequest`` for all, or a list of n."""
    if given is None or isinstance(given, LoRARequest):
        return [given] * n
    if isinstance(given, (str, bytes)) or not isinstance(given, Sequence):
        raise ValueError(f"lora_request must be a LoRARequest, a list of them (None for the base "
                         f"model) or None, got {type(given).__name__}")
    per_prompt = list(given)
    if len(per_prompt) != n:
        raise ValueError(f"lora_request: {len(per_prompt)} given for {n} prompts "
                         "(give one for all, or one per prompt)")
    for i, lr in enumerate(per_prompt):
        if lr is not None and not isinstance(lr, LoRARequest):
            raise ValueError(f"lora_request[{i}] must be a LoRARequest or None, got {type(lr).__name__}")
    return per_prompt


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
