"""The draft-model proposer: a small model with the target's tokenizer drafts greedily.

The draft runs on the target's device (rank 0's under tensor parallelism, unsharded) with a
``ModelRunner`` and a ``BlockManager`` of its own. Each target sequence has a *shadow*
``Sequence`` (same ``seq_id``) holding the draft's KV state. Every ``propose`` first syncs the
shadow to the target's verified tokens: the common prefix keeps its K/V, the rest (rejected
drafts) is rolled back and its blocks freed. Then k rounds run all the step's shadows in one
forward each: round 1 the tokens each shadow owes (a long first prompt is chunked to the
target's step budget; such a shadow drafts nothing until it has caught up), rounds 2..k the
token drafted in the round before.

Drafting is greedy on purpose: the engine accepts a draft when it equals the target's own sample,
which needs no draft probabilities and keeps seeded outputs identical to decoding without
speculation. A full draft pool only costs drafts (that sequence gets none this step), never an
error, and never another live shadow's blocks.

The engine imports this package, so nothing here imports the engine's modules at run time: the
engine hands in the classes the draft runs on (``EngineParts``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from batchinfer.workers.engine_config import EngineConfig
from batchinfer.workers.models import load_model
from batchinfer.workers.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from batchinfer.workers.engine.block_manager import BlockManager
    from batchinfer.workers.engine.model_runner import ModelRunner
    from batchinfer.workers.engine.sequence import Sequence
    from batchinfer.workers.engine.step_scheduler import ScheduledSequence

# Default draft KV cache: max_num_seqs sequences of max_model_len tokens, at most this many blocks
# (a draft is small: 4096 blocks of 16 tokens of a 0.5B model's K/V is well under 1 GiB).
DEFAULT_MAX_DRAFT_KV_BLOCKS = 4096

# The parts of tokenizer.json that decide how text becomes ids (besides the vocabulary itself).
_TOKENIZER_PARTS = ("model", "added_tokens", "normalizer", "pre_tokenizer")


@dataclass(frozen=True)
class EngineParts:
    """The engine's classes a draft model runs on, handed in by the engine (which imports this
    package: importing them here would make a package circle)."""

    model_runner: type[ModelRunner]
    block_manager: type[BlockManager]
    sequence: type[Sequence]
    scheduled_sequence: type[ScheduledSequence]


class DraftModelProposer:
    """Drafts with a smaller model that shares the target's tokenizer (``method = "draft"``)."""

    method = "draft"

    def __init__(self, model_dir: str, target: EngineConfig, target_tokenizer: Tokenizer,
                 target_vocab_size: int, max_model_len: int, parts: EngineParts,
                 num_kv_blocks: int | None = None) -> None:
        """Load the draft in ``model_dir`` (ValueError ``"speculative_config.model: ..."`` when its
        tokenizer is not the target's) with a KV cache of ``num_kv_blocks`` blocks (None: enough
        for ``target.max_num_seqs`` sequences of ``max_model_len`` tokens, at most
        ``DEFAULT_MAX_DRAFT_KV_BLOCKS``). Drafts are ids below ``target_vocab_size``."""
        check_same_tokenizer(Tokenizer.from_dir(model_dir), target_tokenizer)
        device = str(target.torch_device)  # rank 0's device: the draft is never sharded
        self.model = load_model(model_dir, target.dtype, device)
        mc = self.model.config
        self.max_model_len = min(max_model_len, mc.max_position_embeddings)
        self.vocab_size = min(target_vocab_size, mc.vocab_size)  # argmax range of a draft
        self.draft_vocab_size = mc.vocab_size  # ids the draft can read
        bs = target.block_size
        if num_kv_blocks is None:
            per_seq = -(-self.max_model_len // bs)
            num_kv_blocks = min(DEFAULT_MAX_DRAFT_KV_BLOCKS, target.max_num_seqs * per_seq)
        self.config = EngineConfig(
            model=model_dir, dtype=target.dtype, device=device, block_size=bs, num_kv_blocks=num_kv_blocks,
            max_num_seqs=target.max_num_seqs, max_num_batched_tokens=target.max_num_batched_tokens,
            enable_prefix_caching=False, enforce_eager=True, attention_backend=target.attention_backend)
        self.parts = parts
        self.runner = parts.model_runner(self.model, self.config, self.max_model_len)
        self.block_manager = parts.block_manager(self.runner.num_blocks, bs, enable_prefix_caching=False)
        self.max_num_batched_tokens = target.max_num_batched_tokens
        self._shadows: dict[int, Sequence] = {}  # target seq_id -> the draft's sequence
        self._synced: dict[int, int] = {}  # seq_id -> the target's length at its last propose
        # Statistics for metrics.
        self.num_forwards = 0  # draft forward passes
        self.num_draft_tokens = 0  # drafts returned
        self.num_catch_up_tokens = 0  # verified tokens the draft ran (round 1 of each propose)

    @classmethod
    def from_config(cls, spec_config: Any, engine_config: EngineConfig, tokenizer: Tokenizer,
                    vocab_size: int, max_model_len: int, engine_parts: EngineParts) -> DraftModelProposer:
        """The proposer a ``SpeculativeConfig`` (``model``, ``draft_num_kv_blocks``) asks for."""
        return cls(spec_config.model, engine_config, tokenizer, vocab_size, max_model_len, engine_parts,
                   num_kv_blocks=spec_config.draft_num_kv_blocks)

    # -- the proposer protocol ------------------------------------------------------------------

    def propose(self, seqs: Seq[Sequence], max_tokens: Seq[int]) -> list[list[int]]:
        """Greedy drafts for each of ``seqs`` (at most ``max_tokens[i]``; [] when the sequence is
        still catching up, does not fit the draft's pool or length, or holds ids the draft lacks)."""
        drafts: list[list[int]] = [[] for _ in seqs]
        budget, scheduled = self.max_num_batched_tokens, self.parts.scheduled_sequence
        active: list[tuple[int, Sequence, int]] = []  # (index in seqs, shadow, rounds)
        step: list[ScheduledSequence] = []
        for i, (seq, k) in enumerate(zip(seqs, max_tokens, strict=True)):
            n_tokens = len(seq.token_ids)
            k = min(k, self.max_model_len - n_tokens + 1)  # the last draft is never run
            if k < 1 or budget < 1 or not n_tokens:
                continue
            shadow = self._sync(seq)
            start = shadow.num_computed_tokens
            owed = shadow.num_tokens - start
            n = min(owed, budget)
            if max(shadow.token_ids[start:start + n]) >= self.draft_vocab_size:
                continue
            catching_up = n < owed
            if not self.block_manager.allocate(shadow, n if catching_up else n + k - 1):
                continue  # the pool is full: no drafts this step
            budget -= n
            self.num_catch_up_tokens += n
            step.append(scheduled(shadow, start, n, not catching_up))
            if catching_up:
                shadow.num_computed_tokens = start + n
            else:
                active.append((i, shadow, k))
        round_no = 1
        while step:
            logits = self.runner.execute(step)  # [len(active), V] in active's order
            self.num_forwards += 1
            tokens = logits[:, :self.vocab_size].argmax(dim=-1).tolist()
            step, still = [], []
            for (i, shadow, k), token in zip(active, tokens, strict=True):
                shadow.num_computed_tokens = shadow.num_tokens  # as StepScheduler.commit
                shadow.append_token(token)
                drafts[i].append(token)
                if round_no < k:
                    still.append((i, shadow, k))
                    step.append(scheduled(shadow, shadow.num_tokens - 1, 1, True))
            active = still
            round_no += 1
        self.num_draft_tokens += sum(map(len, drafts))
        return drafts

    def release(self, seq: Sequence) -> None:
        """Free ``seq``'s shadow and its blocks (a no-op for a sequence never proposed for)."""
        shadow = self._shadows.pop(seq.seq_id, None)
        self._synced.pop(seq.seq_id, None)
        if shadow is not None:
            self.block_manager.free(shadow)

    def close(self) -> None:
        """Release every shadow (nothing runs outside this process)."""
        for shadow in list(self._shadows.values()):
            self.release(shadow)
        self.runner.close()

    @property
    def num_shadows(self) -> int:
        """Sequences whose draft state is held."""
        return len(self._shadows)

    # -- the draft's state ----------------------------------------------------------------------

    def _sync(self, seq: Sequence) -> Sequence:
        """``seq``'s shadow holding exactly ``seq.token_ids``, K/V kept for their common prefix
        (at least the last token is owed: its logits draft the first token)."""
        target = seq.token_ids
        shadow = self._shadows.get(seq.seq_id)
        own = shadow.token_ids if shadow is not None else []
        # token_ids only grows: up to the length last synced the two agree (checked at its end).
        common = self._synced.get(seq.seq_id, 0)
        if shadow is None or common > len(target) or own[common - 1] != target[common - 1]:
            self.release(seq)  # new (or, defensively, not a continuation): start over
            # Never RUNNING: when the runner's block-table rows run out it may reclaim the row of
            # a shadow not in the step, which only costs rewriting it when the shadow runs again.
            shadow = self._shadows[seq.seq_id] = self.parts.sequence(seq.seq_id, None, 0, target)
            self._synced[seq.seq_id] = len(target)
            return shadow
        while common < len(own) and common < len(target) and own[common] == target[common]:
            common += 1
        computed = min(shadow.num_computed_tokens, common, len(target) - 1)
        del own[common:]  # the rejected drafts
        own.extend(target[common:])
        del shadow.output_token_ids[common - shadow.num_prompt_tokens:]  # the prompt is <= common
        shadow.output_token_ids.extend(target[common:])
        shadow.num_computed_tokens = computed
        self.block_manager.trim(shadow, computed)  # the rejected drafts' blocks
        self._synced[seq.seq_id] = len(target)
        return shadow


def check_same_tokenizer(draft: Tokenizer, target: Tokenizer) -> None:
    """ValueError ``"speculative_config.model: ..."`` naming what differs when ``draft`` would not
    turn text into the same ids as ``target`` (its drafts would be another vocabulary's)."""
    dv, tv = draft.backend.get_vocab(with_added_tokens=True), target.backend.get_vocab(with_added_tokens=True)
    if dv != tv:
        if len(dv) != len(tv):
            what = f"the vocabularies have {len(dv)} (draft) and {len(tv)} (target) tokens"
        else:
            token = min((t for t in dv if tv.get(t) != dv[t]), key=lambda t: dv[t])
            other = f"id {tv[token]}" if token in tv else "absent"
            what = f"token {token!r} is id {dv[token]} in the draft, {other} in the target"
        raise ValueError(f"speculative_config.model: the draft model's tokenizer differs from the "
                         f"target's ({what}); a draft model must share the target's tokenizer")
    dj, tj = json.loads(draft.backend.to_str()), json.loads(target.backend.to_str())
    for part in _TOKENIZER_PARTS:
        if dj.get(part) != tj.get(part):
            raise ValueError(f"speculative_config.model: the draft model's tokenizer differs from the "
                             f"target's (tokenizer.json's {part!r} differs); a draft model must share "
                             "the target's tokenizer")
