"""The draft-model proposer (workers/spec/draft.py): greedy drafts of a real tiny draft model, the
shadow KV state synced to the target's verified tokens, a full pool, a foreign tokenizer."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from safetensors.torch import load_file, save_file

from batchinfer.workers.engine.block_manager import BlockManager
from batchinfer.workers.engine.engine import Engine
from batchinfer.workers.engine.model_runner import ModelRunner
from batchinfer.workers.engine.sequence import Sequence
from batchinfer.workers.engine.step_scheduler import ScheduledSequence
from batchinfer.workers.engine_config import EngineConfig
from batchinfer.workers.models.tiny import make_tiny_model
from batchinfer.workers.sampling_params import SamplingParams
from batchinfer.workers.spec.draft import DraftModelProposer, EngineParts
from batchinfer.workers.spec.proposer import Proposer
from batchinfer.workers.text.tokenizer import Tokenizer

VOCAB = 320  # the tiny models' vocabulary
PARTS = EngineParts(ModelRunner, BlockManager, Sequence, ScheduledSequence)
PROMPTS = ([5, 80, 17, 230, 41, 9, 77], [300, 2, 65, 66, 67, 12, 190, 44, 101, 3, 58])
_ids = itertools.count()


@pytest.fixture(scope="module")
def target(tiny_llama: Path) -> Engine:
    return Engine(EngineConfig(model=str(tiny_llama), num_kv_blocks=64))


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another random Llama (seed 1) with the same byte-level tokenizer."""
    return make_tiny_model(tmp_path_factory.mktemp("draft") / "tiny-llama-1", seed=1)


def greedy(engine: Engine, prompt: list[int], n: int) -> list[int]:
    """The target's own greedy continuation of ``prompt``: ``n`` tokens."""
    rid = f"r{next(_ids)}"
    engine.add_request(rid, prompt_token_ids=prompt,
                       sampling_params=SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out.outputs[0].token_ids


def proposer(model: Path, tokenizer: Tokenizer, num_kv_blocks: int | None = 64,
             **target: int) -> DraftModelProposer:
    config = EngineConfig(model=str(model), **target)
    return DraftModelProposer(str(model), config, tokenizer, VOCAB, 512, PARTS, num_kv_blocks=num_kv_blocks)


def shrink_vocabulary(model: Path, rows: int) -> Path:
    """Cut the checkpoint's embedding and LM head to their first ``rows`` rows (the tiny builder
    refuses a vocabulary smaller than its tokenizer's)."""
    weights = load_file(model / "model.safetensors")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        weights[name] = weights[name][:rows].clone()
    save_file(weights, model / "model.safetensors")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "vocab_size": rows}))
    return model


def seq_of(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, None, 0, tokens)


def test_the_target_as_its_own_draft_drafts_its_greedy_continuation(tiny_llama, target):
    refs = [greedy(target, p, 12) for p in PROMPTS]
    p = proposer(tiny_llama, target.tokenizer)
    seqs = [seq_of(i, prompt) for i, prompt in enumerate(PROMPTS)]
    assert p.propose(seqs, [6, 3]) == [refs[0][:6], refs[1][:3]]
    assert (p.num_forwards, p.num_draft_tokens) == (6, 9)
    # Next step: seq 0 accepted all 6 and got the bonus token, seq 1 kept 2 of its 3.
    seqs[0].token_ids += refs[0][:7]
    seqs[1].token_ids += refs[1][:2]
    assert p.propose(seqs, [4, 5]) == [refs[0][7:11], refs[1][2:7]]


def test_another_draft_model_drafts_other_tokens(tiny_llama, target, other_draft):
    ref = greedy(target, PROMPTS[0], 8)
    drafts = proposer(other_draft, target.tokenizer).propose([seq_of(0, PROMPTS[0])], [8])
    assert len(drafts[0]) == 8 and drafts[0] != ref
    assert proposer(other_draft, target.tokenizer).propose([seq_of(0, PROMPTS[0])], [8]) == drafts


@pytest.mark.parametrize(("accepted", "forced"), [(0, []), (2, []), (4, []), (1, [21, 22, 23])])
def test_rejected_drafts_leave_no_trace(target, other_draft, accepted, forced):
    """After a verify step that accepts only some drafts (then appends the target's token and maybe
    tokens a grammar forces), the drafts are those of a fresh proposer for the same tokens: the
    K/V of the rejected positions is not read, their blocks are freed."""
    p = proposer(other_draft, target.tokenizer, block_size=4)
    seqs = [seq_of(0, PROMPTS[0]), seq_of(1, PROMPTS[1])]
    first = p.propose(seqs, [4, 4])
    for seq, drafts in zip(seqs, first, strict=True):
        bonus = (drafts[accepted] + 1) % VOCAB if accepted < 4 else 7  # rejects the next draft
        seq.token_ids += [*drafts[:accepted], bonus, *forced]
    again = p.propose(seqs, [5, 5])
    fresh = proposer(other_draft, target.tokenizer, block_size=4)
    assert again == fresh.propose([seq_of(0, seqs[0].token_ids), seq_of(1, seqs[1].token_ids)], [5, 5])
    # Each shadow holds the blocks of the tokens it computed (its last draft is never run), no more.
    for seq, shadow in ((s, p._shadows[s.seq_id]) for s in seqs):
        assert shadow.token_ids == seq.token_ids + again[seq.seq_id]
        assert shadow.num_computed_tokens == shadow.num_tokens - 1
        assert len(shadow.block_table) == -(-shadow.num_computed_tokens // 4)
    used = sum(len(p._shadows[s.seq_id].block_table) for s in seqs)
    assert p.block_manager.num_free_blocks == p.block_manager.num_blocks - used


def test_a_shadow_regrown_with_other_blocks_never_writes_into_its_old_ones(tiny_llama, target):
    """A's rollback frees a block that B then takes while A's pool request fails; when A grows again
    (another block), its K/V must not land in the block B now holds."""
    p = proposer(tiny_llama, target.tokenizer, num_kv_blocks=5, block_size=4)
    a, b = seq_of(0, [5, 80, 17, 230, 41]), seq_of(1, [300, 2])
    da, db = p.propose([a, b], [8, 1])  # A: 12 slots, 3 blocks; B: 1 block
    old_a = list(p._shadows[0].block_table)
    a.token_ids.append((da[0] + 1) % VOCAB)  # A's drafts all rejected: its third block is freed
    b.token_ids += [*db, 9]
    da, db = p.propose([a, b], [12, 2])  # A asks 17 slots (5 blocks): refused; B takes A's block
    assert da == [] and old_a[2] in p._shadows[1].block_table
    assert len(p.propose([a], [6])[0]) == 6  # A grows to 3 blocks again, with another third one
    assert p._shadows[0].block_table[2] != old_a[2]
    b.token_ids += [*db, 9]
    p.release(a)  # room for B's third block
    fresh = proposer(tiny_llama, target.tokenizer, block_size=4)
    expected = [greedy(target, b.token_ids, 3)]
    assert p.propose([b], [3]) == fresh.propose([seq_of(1, b.token_ids)], [3]) == expected


def test_drafts_stay_in_both_vocabularies(tiny_llama, target, tmp_path):
    p = DraftModelProposer(str(tiny_llama), EngineConfig(model=str(tiny_llama)), target.tokenizer, 100, 512,
                           PARTS, num_kv_blocks=16)
    drafts = p.propose([seq_of(i, prompt) for i, prompt in enumerate(PROMPTS)], [8, 8])
    assert all(0 <= t < 100 for d in drafts for t in d) and all(len(d) == 8 for d in drafts)
    # A draft whose embedding has fewer rows than the tokenizer: a sequence holding an id it lacks
    # gets no drafts (no error); the others still do.
    small = shrink_vocabulary(make_tiny_model(tmp_path / "small-vocab", seed=2), 300)
    p = proposer(small, target.tokenizer, num_kv_blocks=16)
    drafts = p.propose([seq_of(0, [5, 310, 7]), seq_of(1, PROMPTS[0])], [3, 3])
    assert drafts[0] == [] and len(drafts[1]) == 3 and max(drafts[1]) < 300


def test_a_long_prompt_catches_up_in_chunks_of_the_step_budget(tiny_llama, target):
    prompt = list(range(10, 30))  # 20 tokens over a budget of 8 a step
    p = proposer(tiny_llama, target.tokenizer, max_num_batched_tokens=8)
    seq = seq_of(0, prompt)
    assert p.propose([seq], [3]) == [[]]
    assert p.propose([seq], [3]) == [[]]
    assert p.propose([seq], [3]) == [greedy(target, prompt, 3)]
    assert p.num_catch_up_tokens == 20


def test_release_returns_every_block(tiny_llama, target):
    p = proposer(tiny_llama, target.tokenizer, block_size=4)
    seqs = [seq_of(i, prompt) for i, prompt in enumerate(PROMPTS)]
    for _ in range(3):
        drafts = p.propose(seqs, [3, 2])
        for seq, d in zip(seqs, drafts, strict=True):
            seq.token_ids += d[:1] + [11]
    assert p.block_manager.num_free_blocks < p.block_manager.num_blocks
    p.release(seq_of(99, [1]))  # never proposed for: a no-op
    for seq in seqs:
        p.release(seq)
    assert p.num_shadows == 0
    assert p.block_manager.num_free_blocks == p.block_manager.num_blocks
    assert p.block_manager.ref_counts == [0] * p.block_manager.num_blocks


def test_a_sequence_the_pool_cannot_hold_gets_no_drafts(tiny_llama, target):
    p = proposer(tiny_llama, target.tokenizer, num_kv_blocks=2, block_size=4)  # 8 tokens in all
    short, long = seq_of(0, [5, 6, 7]), seq_of(1, list(range(40, 60)))
    drafts = p.propose([long, short], [2, 2])
    assert drafts == [[], greedy(target, [5, 6, 7], 2)]
    short.token_ids += [*drafts[1], 9]  # 6 tokens and 3 drafts: 8 slots, the pool's second block
    assert len(p.propose([long, short], [4, 3])[1]) == 3
    assert p.propose([long, short], [4, 4]) == [[], []]  # 6 tokens and 4 drafts: 9 slots, 3 blocks
    p.release(short)
    p.release(long)
    assert p.block_manager.num_free_blocks == 2


def test_from_config_sizes_the_draft_cache_by_default(tiny_llama, target):
    spec = SimpleNamespace(model=str(tiny_llama), draft_num_kv_blocks=None)
    config = EngineConfig(model=str(tiny_llama), max_num_seqs=3, block_size=16)
    p = DraftModelProposer.from_config(spec, engine_config=config, tokenizer=target.tokenizer,
                                       vocab_size=VOCAB, max_model_len=100, engine_parts=PARTS)
    assert p.block_manager.num_blocks == 3 * 7  # 3 sequences of 100 tokens in blocks of 16
    assert p.method == "draft" and isinstance(p, Proposer)


def swap_two_ids(data: dict) -> None:
    vocab = data["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]


def drop_a_merge(data: dict) -> None:
    data["model"]["merges"].pop()


@pytest.mark.parametrize(("edit", "names"), [(swap_two_ids, "is id 100 in the draft, id 101 in the target"),
                                             (drop_a_merge, "tokenizer.json's 'model' differs")])
def test_a_draft_with_another_tokenizer_is_refused(tiny_llama, target, tmp_path, edit, names):
    draft = Path(shutil.copytree(tiny_llama, tmp_path / "draft"))
    data = json.loads((draft / "tokenizer.json").read_text())
    edit(data)
    (draft / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"^speculative_config\.model: the draft model's tokenizer") as e:
        proposer(draft, target.tokenizer)
    assert names in str(e.value)
