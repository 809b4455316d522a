"""``StructuredOutputManager``: what the engine drives each step for constrained requests.

Per step, for the rows that sample this step and carry a matcher:

1. ``begin(seqs)`` (before the forward) fills the token bitmask of those rows on a helper thread
   (llguidance computes masks without the GIL, so the fill overlaps the model's forward); a step
   that verifies draft tokens (speculative decoding) adds a row per draft, the mask of the state
   after the drafts before it (``cut_drafts`` keeps only drafts the grammar accepts);
2. ``apply(logits)`` (after it) joins the fill and sets the banned logits of just those rows to
   ``-inf``, before the sampler's penalties / top-k / top-p. Free rows are never touched.

A row whose grammar forces its next bytes (a fixed key, a ``":"``) gets a one-token mask: the
first token of the tokenizer's own tokenization of the forced text (``Matcher.forced_tokens``),
not any of the tokens that merely spell a prefix of it. With ``jump_forward`` on, ``jump_forward``
then appends the rest of the forced tokens right after the sampled one, without a sampling step
each (the next forward computes them as one chunk); with it off each takes a step with that
one-token mask, so greedy outputs are the same either way.

``accept`` advances a completion's matcher by one token and turns grammar termination into
``finish_reason "stop"``; ``complete`` says whether a completion's text is a full match.

Every grammar failure while decoding (a token the matcher rejects, a parser or lexer limit hit, a
mask or forced-token computation that raised) reaches the engine as ``StructuredOutputError`` from
``accept`` or ``jump_forward``: the engine ends that request alone with ``error_code
"invalid_request"`` (the worker's row for it, never a retry), and the batch goes on.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from batchinfer.workers.structured.backend import GrammarBackend, Matcher, StructuredOutputError
from batchinfer.workers.structured.bitmask import apply_bitmask
from batchinfer.workers.structured.factory import make_backend
from batchinfer.workers.structured_params import StructuredOutputsParams
from batchinfer.workers.text.stopping import StopResult

if TYPE_CHECKING:
    from batchinfer.workers.engine.sequence import Sequence as Seq
    from batchinfer.workers.engine_config import StructuredConfig
    from batchinfer.workers.text.tokenizer import Tokenizer


class StructuredOutputManager:
    """One engine's grammar backend (built on the first constrained request), its step bitmask and
    its counters (see the module docstring)."""

    def __init__(self, config: StructuredConfig, tokenizer: Tokenizer, vocab_size: int,
                 eos_token_ids: Sequence[int], max_num_seqs: int) -> None:
        """``vocab_size``: the model's (the logits' width); ``eos_token_ids``: the engine's;
        ``max_num_seqs``: the step's most sampling rows (the bitmask's first size)."""
        self.config = config
        self.max_num_seqs = max_num_seqs
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.jump_forward_enabled = config.jump_forward
        self._backend: GrammarBackend | None = None
        self._bitmask: torch.Tensor | None = None  # int32 [max_num_seqs, ceil(V / 32)], reused
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._fill: concurrent.futures.Future[float] | None = None  # this step's fill: its seconds
        self._rows: torch.Tensor | None = None  # [R] int64: the logits rows the fill is for
        self._failures: dict[int, str] = {}  # seq_id -> why its mask fill failed (raised by accept)
        # Counters for metrics and the benchmark.
        self.num_steps = 0  # steps with at least one constrained sampling row
        self.num_rows_filled = 0  # rows whose mask the backend computed
        self.num_rows_forced = 0  # rows given a one-token mask (forced text)
        self.num_jump_forward_tokens = 0  # tokens appended without a sampling step
        self.mask_fill_seconds = 0.0  # wall time of the fills (on the helper thread)
        self.mask_wait_seconds = 0.0  # time the engine waited for a fill after the forward

    # -- compiling ------------------------------------------------------------------------------

    @property
    def backend(self) -> GrammarBackend:
        """The grammar backend, built for the engine's tokenizer on first use."""
        if self._backend is None:
            c = self.config
            self._backend = make_backend(c.backend, self.tokenizer, self.vocab_size,
                                         self.eos_token_ids, limits=c.limits,
                                         cache_size=c.grammar_cache_size, num_threads=c.grammar_threads)
        return self._backend

    @property
    def num_compiles(self) -> int:
        """Grammars compiled so far (cache misses); 0 before the first constrained request."""
        return self._backend.num_compiles if self._backend is not None else 0

    def matchers_for(self, params: StructuredOutputsParams, n: int) -> list[Matcher]:
        """``n`` fresh matchers for ``params`` (compiled once, cached by the backend).

        ``ValueError`` starting ``"structured_outputs:"`` when the spec cannot be served."""
        try:
            compiled = self.backend.compile(params)
            return [self.backend.matcher(compiled) for _ in range(n)]
        except (StructuredOutputError, ValueError) as e:
            raise ValueError(f"structured_outputs: {e}") from None

    # -- the step -------------------------------------------------------------------------------

    def begin(self, seqs: Sequence[Seq], drafts: Sequence[Sequence[int]] | None = None) -> None:
        """Start filling the masks of the constrained rows among this step's sampling rows
        (``seqs``, in logits-row order) on the helper thread.

        ``drafts`` (a step that verifies draft tokens): ``seqs[j]``'s drafts, whose rows follow its
        own in the logits; a constrained sequence's row i gets the mask of the state after its
        first i drafts (which ``cut_drafts`` checked)."""
        self._join()  # a fill left over from a step whose forward raised
        self._rows = None
        if drafts is None:
            rows = [i for i, s in enumerate(seqs) if s.matcher is not None]
            work: list[tuple[Seq, Sequence[int]]] = [(seqs[i], ()) for i in rows]
        else:
            rows, work, at = [], [], 0
            for seq, d in zip(seqs, drafts, strict=True):
                if seq.matcher is not None:
                    rows.extend(range(at, at + 1 + len(d)))
                    work.append((seq, d))
                at += 1 + len(d)
        if not rows:
            return
        if self._bitmask is None:
            self._bitmask = self.backend.allocate_bitmask(max(self.max_num_seqs, len(rows)))
        elif self._bitmask.shape[0] < len(rows):
            self._bitmask = self.backend.allocate_bitmask(len(rows))
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        self._rows = torch.tensor(rows, dtype=torch.int64)
        self._fill = self._pool.submit(self._fill_masks, work, self._bitmask)
        self.num_steps += 1

    def _fill_masks(self, work: list[tuple[Seq, Sequence[int]]], bitmask: torch.Tensor) -> float:
        """The rows of ``bitmask``, in ``work``'s order: a sequence's own row (one token where the
        text is forced, else the backend's mask) and one per draft token it runs. Runs on the
        helper thread; returns its wall time."""
        t0 = time.perf_counter()
        words = bitmask.numpy()  # a view: single-word writes without tensor indexing overhead
        fill: list[tuple[Matcher, int]] = []
        next_row = 0
        for seq, drafts in work:
            row, next_row = next_row, next_row + 1 + len(drafts)
            if drafts:  # the matcher walks through them: filled one row at a time, now
                self._fill_draft_rows(seq, drafts, words, bitmask, row)
                continue
            matcher = _matcher(seq)
            try:
                forced = seq.forced_tokens
                if forced is None:  # not known at this state yet
                    forced = seq.forced_tokens = matcher.forced_tokens()
            except Exception as e:  # noqa: BLE001 - one broken matcher must not fail the step
                self._fail(seq, e, words[row])
                continue
            if forced:
                self._force(words, row, forced[0])
            else:
                fill.append((matcher, row))
        try:
            self.backend.fill_bitmask(fill, bitmask)
        except Exception:  # noqa: BLE001 - find the row that fails; the others still get their masks
            seq_of = {id(seq.matcher): seq for seq, _ in work}
            for matcher, row in fill:
                try:
                    self.backend.fill_bitmask([(matcher, row)], bitmask)
                except Exception as e:  # noqa: BLE001
                    self._fail(seq_of[id(matcher)], e, words[row])
        self.num_rows_filled += len(fill)
        return time.perf_counter() - t0

    def _force(self, words: Any, row: int, token: int) -> None:
        """A one-token mask: the first token of the forced text."""
        words[row] = 0
        words[row, token // 32] = _bit(token % 32)
        self.num_rows_forced += 1

    def _fill_draft_rows(self, seq: Seq, drafts: Sequence[int], words: Any, bitmask: torch.Tensor,
                         first: int) -> None:
        """Rows ``first .. first + len(drafts)`` of a sequence that runs ``drafts``: row i is the
        mask after ``drafts[:i]``, filled while the matcher walks through them (then rolled back)."""
        matcher = _matcher(seq)
        walked = 0
        try:
            for i in range(len(drafts) + 1):
                forced = seq.forced_tokens if i == 0 else None
                if forced is None:
                    forced = matcher.forced_tokens()
                    if i == 0:
                        seq.forced_tokens = forced
                if forced:
                    self._force(words, first + i, forced[0])
                else:
                    self.backend.fill_bitmask([(matcher, first + i)], bitmask)
                    self.num_rows_filled += 1
                if i < len(drafts):
                    if not matcher.accept(drafts[i]):  # cut_drafts checked them: a backend fault
                        raise StructuredOutputError(f"draft token {drafts[i]} was refused after validation")
                    walked += 1
        except Exception as e:  # noqa: BLE001 - one broken matcher must not fail the step
            for i in range(len(drafts) + 1):
                self._fail(seq, e, words[first + i])
        finally:
            if walked:
                matcher.rollback(walked)

    def cut_drafts(self, seq: Seq, drafts: list[int]) -> list[int]:
        """The longest prefix of ``drafts`` that ``seq``'s grammar accepts and that walks through
        no state whose next text is forced (there jump-forward appends tokens without sampling,
        so no draft after it could line up). Called before the step, on the engine's thread."""
        matcher = _matcher(seq)
        drafts = drafts[:matcher.validate(drafts)]
        walked = 0
        try:
            for token in drafts:
                if walked and matcher.forced_tokens():
                    break
                if not matcher.accept(token):
                    break
                walked += 1
        except Exception:  # noqa: BLE001 - no drafts then; the step itself reports the failure
            walked = 0
        finally:
            if walked:
                matcher.rollback(walked)
        return drafts[:walked]

    def _fail(self, seq: Seq, error: Exception, row: Any) -> None:
        """Remember why ``seq``'s mask could not be made (``accept`` raises it, which aborts only its
        request) and let its row through unmasked meanwhile."""
        self._failures[seq.seq_id] = f"{type(error).__name__}: {error}"
        row[:] = -1

    @torch.inference_mode()  # the logits are the runner's inference tensors: updated in place
    def apply(self, logits: torch.Tensor) -> None:
        """Join this step's fill and mask the constrained rows of ``logits`` [N, V] in place
        (a no-op when ``begin`` found none)."""
        rows = self._rows
        if rows is None or self._bitmask is None:
            return
        t0 = time.perf_counter()
        self._join()
        self.mask_wait_seconds += time.perf_counter() - t0
        self._rows = None
        apply_bitmask(logits, self._bitmask[:len(rows)], None if len(rows) == logits.shape[0] else rows)

    def _join(self) -> None:
        fill, self._fill = self._fill, None
        if fill is not None:
            self.mask_fill_seconds += fill.result()

    # -- tokens ---------------------------------------------------------------------------------

    def accept(self, seq: Seq, token: int, stop: StopResult | None) -> StopResult | None:
        """Advance ``seq``'s matcher by ``token`` (just appended; ``stop`` is what the stop checks
        said of it) and return how the completion stops: the grammar's termination ends it with
        "stop" unless EOS or a stop string already did. ``StructuredOutputError`` when the
        grammar rejects the token (the engine aborts that request only)."""
        matcher = _matcher(seq)
        seq.forced_tokens = None
        failure = self._failures.pop(seq.seq_id, None) if self._failures else None
        if failure is not None:
            raise StructuredOutputError(f"the grammar's token mask could not be computed: {failure}")
        # A matcher in error stays stopped and may still accept EOS (llguidance does): check first.
        if matcher.error is not None or not matcher.accept(token) or matcher.error is not None:
            why = matcher.error or "not allowed here"
            raise StructuredOutputError(f"the grammar rejected token {token}: {why}")
        if matcher.is_terminated and (stop is None or stop.finish_reason == "length"):
            # The grammar allows nothing but EOS: done, as if EOS had been sampled.
            text = "" if seq.detokenizer is None else _flushed(seq.detokenizer)
            return StopResult("stop", None, text)
        return stop

    def jump_forward(self, seq: Seq, add_token: Callable[[Seq, int], None]) -> None:
        """Append the tokens the grammar forces after ``seq``'s last token, one by one through
        ``add_token`` (which appends, accepts and checks stops as for a sampled token), until the
        next token is a choice or the completion finishes. Requests asking for logprobs do not
        jump: each of their tokens needs its own distribution."""
        if not self.jump_forward_enabled or seq.logprobs is not None:
            return
        # Only the first forced token is taken each time, then the forced text is tokenized again:
        # the same token the one-token mask of a sampling step would allow, so greedy outputs do
        # not depend on jump_forward.
        matcher = _matcher(seq)
        while not seq.is_finished:
            try:
                forced = matcher.forced_tokens()
            except Exception as e:  # noqa: BLE001 - the request's grammar failed: its own error, not the engine's
                raise StructuredOutputError(f"the grammar's forced tokens could not be computed: "
                                            f"{type(e).__name__}: {e}") from e
            if not forced:
                seq.forced_tokens = []  # known: the next sampling step needs no forced-state check
                return
            self.num_jump_forward_tokens += 1
            add_token(seq, forced[0])

    def complete(self, seq: Seq) -> bool | None:
        """Whether ``seq``'s text so far fully matches its constraint; None when unconstrained.
        False once a stop string or stop token cut the text, or the request was aborted."""
        if seq.matcher is None:
            return None
        if seq.finish_reason == "abort" or seq.stop_reason is not None:
            return False
        return bool(seq.matcher.is_accepting) and seq.matcher.error is None

    def stats(self) -> dict[str, Any]:
        """The counters, for metrics and the benchmark."""
        return {"backend": self._backend.name if self._backend is not None else None,
                "num_compiles": self.num_compiles, "num_steps": self.num_steps,
                "num_rows_filled": self.num_rows_filled, "num_rows_forced": self.num_rows_forced,
                "num_jump_forward_tokens": self.num_jump_forward_tokens,
                "mask_fill_seconds": self.mask_fill_seconds, "mask_wait_seconds": self.mask_wait_seconds}

    def close(self) -> None:
        """Stop the helper thread (the engine is done)."""
        self._join()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _matcher(seq: Seq) -> Matcher:
    if seq.matcher is None:
        raise RuntimeError(f"{seq!r} has no grammar matcher")
    return seq.matcher


def _bit(i: int) -> int:
    """The int32 word with only bit ``i`` set (bit 31 is the sign bit)."""
    return -(2**31) if i == 31 else 1 << i


def _flushed(detok: Any) -> str:
    detok.flush()
    return detok.text
