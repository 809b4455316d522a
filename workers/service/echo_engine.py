"""``EchoEngine``: an ``Engine`` look-alike that answers without a model.

It implements what the worker daemon drives (:class:`~batchinfer.workers.engine.interface.WorkerEngine`:
``add_request`` / ``abort`` / ``step`` / ``has_unfinished`` / ``num_unfinished`` / ``capacity`` /
``tokenizer_files`` / ``model_name`` / ``eos_token_ids`` and the statistics), and has a
``tokenizer``, so the worker daemon, the queue benchmarks and the reliability tests run the whole
queue at Redis speed on any machine.

"Generation" echoes the prompt: the completion is the prompt's tokens (repeated when
``min_tokens`` asks for more) cut at ``max_tokens``; ``finish_reason`` is ``"length"`` when
``max_tokens`` cut it, else ``"stop"``. Each ``step()`` finishes at most ``requests_per_step``
waiting requests in arrival order, after an optional ``step_delay``. ``abort`` hands out an
``"abort"`` output with the next step, as the real engine does.

LoRA adapters: ``adapters=[names]`` are served (``add_request(lora=NAME)``; a name not served is
a ``ValueError`` naming those served), and a completion run with adapter NAME has its text
prefixed ``"[NAME] "`` (:func:`adapter_marker`; the tokens are the echo's), so routing tests see
which adapter answered. All served adapters are resident (``resident_adapters()``), or, with
``max_loras=N``, the N used last (an LRU, none at first), so cache-affinity tests can see them move.

Two methods are where a subclass fails on purpose (the reliability tests' fault-injecting echo
engine, tests/faulty_echo.py, served with ``batchinfer worker --echo-class``): ``check_step``
raising makes ``step()`` raise with nothing changed (as a failed forward pass would), and
``check_request`` raising makes that request finish with ``finish_reason="abort"`` and an
``error`` (as the real engine does when one request's postprocessing fails). Here both do nothing.
"""

from __future__ import annotations

import itertools
import json
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchinfer.workers.engine.interface import NoQueueStats, WorkerEngine
from batchinfer.workers.engine.outputs import CompletionOutput, FirstToken, RequestOutput, StepStats
from batchinfer.workers.sampling_params import SamplingParams
from batchinfer.workers.text.tokenizer_files import read_tokenizer_files

BOS, EOS = "<s>", "</s>"
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")


def byte_tokenizer_files() -> dict[str, bytes]:
    """A byte-level tokenizer's files (token id = byte value; ``<s>`` 256, ``</s>`` 257; a chat template).

    What ``batchinfer worker --echo`` registers when no model folder is given, so the scheduler
    tokenises and renders chats with the tokenizer the echo engine decodes with. Built here rather
    than taken from ``workers.models.tiny`` because that module imports torch, which an echo worker
    (benchmarks measure its memory) does not otherwise load.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(_byte_alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BOS, EOS])
    config = {"bos_token": BOS, "eos_token": EOS, "chat_template": CHAT_TEMPLATE}
    return {
        "tokenizer.json": tok.to_str().encode(),
        "tokenizer_config.json": json.dumps(config).encode(),
        "generation_config.json": json.dumps({"bos_token_id": 256, "eos_token_id": 257}).encode(),
    }


def _byte_alphabet() -> list[str]:
    """ByteLevel's printable stand-in of each byte 0..255, in byte order (GPT-2's table)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)}
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


@dataclass
class _Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    lora: str | None = None


def adapter_marker(name: str) -> str:
    """What the echo engine puts before the text of a completion run with adapter ``name``."""
    return f"[{name}] "


class EchoEngine(NoQueueStats, WorkerEngine):
    """An engine that echoes prompts; see the module docstring for its exact behaviour."""

    def __init__(
        self,
        model_name: str = "echo",
        *,
        tokenizer_files: Mapping[str, bytes] | None = None,
        max_num_seqs: int = 256,
        max_model_len: int = 4096,
        max_num_batched_tokens: int = 8192,
        kv_tokens: int | None = None,
        requests_per_step: int = 8,
        step_delay: float = 0.0,
        adapters: Sequence[str] = (),
        max_loras: int | None = None,
    ):
        if requests_per_step < 1 or max_num_seqs < 1 or max_model_len < 2:
            raise ValueError("requests_per_step and max_num_seqs must be >= 1, max_model_len >= 2")
        if max_loras is not None and (isinstance(max_loras, bool) or not isinstance(max_loras, int)
                                      or max_loras < 1):
            raise ValueError(f"max_loras must be a positive integer or None, got {max_loras!r}")
        from batchinfer.workers.lora_request import check_adapter_name

        if isinstance(adapters, str):  # one name passed bare (--engine-option adapters=a)
            adapters = [adapters]
        self._adapters = sorted({check_adapter_name(a, "adapters") for a in adapters})
        self.max_loras = max_loras
        self._resident: OrderedDict[str, None] = OrderedDict()  # the LRU with max_loras, last used last
        from batchinfer.workers.text.tokenizer import Tokenizer

        self.model_name = model_name
        self.task = "generate"
        self._tokenizer_files = files = dict(tokenizer_files or byte_tokenizer_files())
        self.tokenizer = Tokenizer.from_files(files["tokenizer.json"], files.get("tokenizer_config.json"),
                                              files.get("generation_config.json"))
        self.eos_token_ids = self.tokenizer.eos_token_ids
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.kv_tokens = kv_tokens if kv_tokens is not None else max_num_seqs * max_model_len
        self.requests_per_step = requests_per_step
        self.step_delay = step_delay
        self.num_generated_tokens = 0
        # Prompt + generated tokens of the requests answered: what an engine without a prefix cache
        # computes for them (the echo engine computes nothing).
        self.num_computed_tokens = 0
        self.step_stats = StepStats()  # the last step's: each answered request's first token
        self._waiting: OrderedDict[str, _Request] = OrderedDict()
        self._pending: list[RequestOutput] = []  # outputs of aborts, handed out by the next step()

    @classmethod
    def from_model_dir(cls, path: str | Path, **kwargs: Any) -> EchoEngine:
        """An echo engine named after, and tokenising like, the model folder ``path``."""
        kwargs.setdefault("model_name", Path(path).name)
        return cls(tokenizer_files=read_tokenizer_files(path), **kwargs)

    # -- the Engine API ---------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
        *,
        lora: str | None = None,
        spec_group: str | None = None,
    ) -> None:
        """Queue a request; ``ValueError`` naming what is wrong (duplicate id, bad prompt, too long,
        an adapter not served). ``spec_group`` is ignored: nothing is drafted here."""
        if request_id in self._waiting:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        if lora is not None and lora not in self._adapters:
            raise ValueError(f"lora: adapter {lora!r} is not served by this engine; it serves: "
                             f"{', '.join(self._adapters) or 'none'}")
        if prompt is not None and prompt_token_ids is None:
            ids = self.tokenizer.encode(prompt)
        elif prompt is None and prompt_token_ids is not None:
            ids = list(prompt_token_ids)
        else:
            raise ValueError("prompt: give exactly one of prompt and prompt_token_ids")
        if not ids:
            raise ValueError("prompt_token_ids must not be empty")
        if isinstance(sampling_params, Mapping):
            sampling_params = SamplingParams.from_dict(sampling_params)
        params = sampling_params or SamplingParams()
        max_tokens = params.max_tokens or 1
        if len(ids) + max_tokens > self.max_model_len:
            raise ValueError(f"max_tokens: {len(ids)} prompt tokens + max_tokens {max_tokens} "
                             f"exceed max_model_len {self.max_model_len}")
        self._waiting[request_id] = _Request(request_id, ids, params, lora)
        if lora is not None and self.max_loras is not None:  # loaded now: the LRU's newest
            self._resident[lora] = None
            self._resident.move_to_end(lora)
            while len(self._resident) > self.max_loras:
                self._resident.popitem(last=False)

    def abort(self, request_id: str) -> None:
        """Stop a request; its output (finish_reason "abort") comes with the next ``step()``."""
        req = self._waiting.pop(request_id, None)
        if req is not None:
            outs = [CompletionOutput(index=i, finish_reason="abort") for i in range(req.params.n)]
            self._pending.append(RequestOutput(request_id, req.prompt_token_ids, outs, finished=True))

    def step(self) -> list[RequestOutput]:
        """Finish up to ``requests_per_step`` requests in arrival order."""
        if self.step_delay:
            time.sleep(self.step_delay)
        chosen = list(itertools.islice(self._waiting.values(), self.requests_per_step))
        self.check_step([(req.request_id, req.prompt_token_ids) for req in chosen])  # may raise
        outputs, self._pending = self._pending, []
        self.step_stats = StepStats()  # _answer fills it
        for req in chosen:
            del self._waiting[req.request_id]
            outputs.append(self._answer(req))
        return outputs

    def check_step(self, requests: list[tuple[str, list[int]]]) -> None:
        """Before a step changes anything, its requests' (id, prompt token ids): raising fails the
        whole step. Nothing here; a fault-injecting subclass raises."""

    def check_request(self, request_id: str) -> None:
        """Before a request is answered: raising finishes it with ``finish_reason="abort"`` and the
        error. Nothing here; a fault-injecting subclass raises."""

    def has_unfinished(self) -> bool:
        """True while a request waits, or an abort's output is not handed out yet."""
        return bool(self._waiting or self._pending)

    def num_unfinished(self) -> int:
        """Requests not answered yet."""
        return len(self._waiting)

    def capacity(self) -> dict[str, int]:
        """The limits given to the constructor (``kv_tokens`` defaults to seqs x length)."""
        return {"max_model_len": self.max_model_len, "max_num_seqs": self.max_num_seqs,
                "max_num_batched_tokens": self.max_num_batched_tokens, "kv_tokens": self.kv_tokens}

    def lora_adapters(self) -> list[str]:
        """The adapters given to the constructor, sorted."""
        return list(self._adapters)

    def resident_adapters(self) -> list[str]:
        """Every served adapter, or with ``max_loras`` the ones used last (oldest first)."""
        return list(self._adapters) if self.max_loras is None else list(self._resident)

    def tokenizer_files(self) -> dict[str, bytes]:
        """The files this engine tokenises with (the byte-level tokenizer's unless given)."""
        return dict(self._tokenizer_files)


    # -- echo ---------------------------------------------------------------------------------------

    def _answer(self, req: _Request) -> RequestOutput:
        try:
            self.check_request(req.request_id)
        except Exception as e:  # as the engine's postprocessing: this request ends, with its error
            outs = [CompletionOutput(index=i, finish_reason="abort") for i in range(req.params.n)]
            out = RequestOutput(req.request_id, req.prompt_token_ids, outs, finished=True)
            out.error = f"{type(e).__name__}: {e}"
            return out
        p = req.params
        prompt = req.prompt_token_ids
        max_tokens = p.max_tokens if p.max_tokens is not None else self.max_model_len - len(prompt)
        want = min(max_tokens, max(len(prompt), p.min_tokens))
        tokens = list(itertools.islice(itertools.cycle(prompt), want))
        reason = "length" if want == max_tokens else "stop"
        text = self.tokenizer.decode(tokens, skip_special_tokens=p.skip_special_tokens)
        if req.lora is not None:
            text = adapter_marker(req.lora) + text
        outputs = [CompletionOutput(index=i, text=text, token_ids=list(tokens), finish_reason=reason)
                   for i in range(p.n)]
        self.num_generated_tokens += want * p.n
        self.num_computed_tokens += len(prompt) + want * p.n
        stats = self.step_stats  # every token of the answer comes out in this one step
        stats.first_tokens.append(FirstToken(req.request_id, len(prompt), 0, time.monotonic()))
        stats.num_generated_tokens += want * p.n
        return RequestOutput(req.request_id, prompt, outputs, num_cached_tokens=0, finished=True)
