"""The compiled layer loop (kernels/cpu_ext/layer_loop.cpp, workers/quant/layer_loop.py): a decode
step's hidden states and cache writes are the Python layers' bit for bit, for every kind of linear
(float32 / bfloat16 / float16 ``GemvLinear`` on both sides of its row limit, int8 and
int4 ``QuantizedLinear`` on both sides of theirs), biases, a sliding window and sequences without a
query; the steps and decoders it does not take go to the Python layers; bad positions and slots
raise before anything is written; an engine gives the same tokens and logprobs with and without it."""

from __future__ import annotations

import shutil

import pytest
import torch

from batchinfer import LLM, SamplingParams
from batchinfer.kernels.cpu_ext import decode
from batchinfer.workers.models import load_model
from batchinfer.workers.models.attention import AttentionMetadata
from batchinfer.workers.models.tiny import make_tiny_model
from batchinfer.workers.quant.apply import quantize_model
from batchinfer.workers.quant.dense import use_gemv
from batchinfer.workers.quant.layer_loop import LayerLoop, unsupported_reason, use_layer_loop

pytestmark = pytest.mark.skipif(shutil.which("c++") is None,
                                reason="no C++ compiler to build the CPU library")

BLOCK = 4  # cache block size
BLOCKS_PER_SEQ = 6  # a sequence holds up to 24 tokens
SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    assert decode.available(), decode.unavailable_reason()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``get(arch, **overrides)``: a tiny checkpoint, written once per argument set."""
    root, made = tmp_path_factory.mktemp("layer-loop"), {}

    def get(arch: str = "LlamaForCausalLM", **overrides):
        key = (arch, tuple(sorted(overrides.items())))
        if key not in made:
            made[key] = make_tiny_model(root / f"m{len(made)}", arch, **{**SMALL, **overrides})
        return made[key]

    return get


def _decoder(path, dtype: torch.dtype, quant: str | None = None):
    model = load_model(str(path), dtype, "cpu", progress=False)
    if quant is not None:
        quantize_model(model, quant)
    use_gemv(model)
    return model


class Run:
    """Sequences prefilled through the Python layers, then decoded a token per step."""

    def __init__(self, model, seqs: int, prompt: int = 5, seed: int = 0):
        self.model, self.seqs = model, seqs
        shape = (seqs * BLOCKS_PER_SEQ, BLOCK, model.num_kv_heads, model.head_dim)
        self.caches = [(torch.zeros(shape, dtype=model.dtype), torch.zeros(shape, dtype=model.dtype))
                       for _ in range(model.num_layers)]
        # Blocks handed out backwards, so that a sequence's blocks are not its neighbour's.
        ids = torch.arange(seqs * BLOCKS_PER_SEQ - 1, -1, -1, dtype=torch.int32)
        self.tables = ids.view(seqs, BLOCKS_PER_SEQ)
        self.lens = [0] * seqs
        self.gen = torch.Generator().manual_seed(seed)
        model.layer_loop = None
        with torch.inference_mode():
            model(*self.step([prompt] * seqs))

    def step(self, counts: list[int], backend: str | None = None):
        """(input_ids, positions, caches, metadata) of a step giving sequence i ``counts[i]`` tokens."""
        positions, slots, cu = [], [], [0]
        for i, n in enumerate(counts):
            for p in range(self.lens[i], self.lens[i] + n):
                positions.append(p)
                slots.append(int(self.tables[i, p // BLOCK]) * BLOCK + p % BLOCK)
            self.lens[i] += n
            cu.append(cu[-1] + n)
        ids = torch.randint(0, self.model.config.vocab_size, (len(positions),), generator=self.gen)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64), block_tables=self.tables,
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
            seq_lens=torch.tensor(self.lens, dtype=torch.int32),
            max_seqlen_q=max(counts), max_seqlen_k=max(self.lens), backend=backend)
        return ids, torch.tensor(positions, dtype=torch.int64), self.caches, meta


def _clone(caches):
    return [(k.clone(), v.clone()) for k, v in caches]


def _decode_both_ways(model, seqs: int, steps: int = 4, counts: list[int] | None = None) -> None:
    """Each decode step once through the loop and once through the Python layers, from the same
    caches: equal hidden states and equal caches after, every step."""
    run, loop = Run(model, seqs), LayerLoop(model)
    for _ in range(steps):
        ids, positions, caches, meta = run.step(counts or [1] * seqs)
        before = _clone(caches)
        with torch.inference_mode():
            fast = loop(model.embed(ids), positions, caches, meta)
            after_fast = _clone(caches)
            for (k, v), (k0, v0) in zip(caches, before, strict=True):  # back to the step's start
                k.copy_(k0)
                v.copy_(v0)
            model.layer_loop = None
            slow = model(ids, positions, caches, meta)
        assert fast is not None, "the loop did not take a decode step"
        assert fast.dtype == slow.dtype and torch.equal(fast, slow), (fast - slow).abs().max()
        for (k, v), (kf, vf) in zip(caches, after_fast, strict=True):
            assert torch.equal(k, kf) and torch.equal(v, vf)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
# 6 rows: past the packed kernels' 4 (int8: the dense copy through the GEMV); 9: past the GEMV's 8
@pytest.mark.parametrize("seqs", [1, 3, 6, 9])
def test_dense_decoders_bit_for_bit(checkpoints, dtype, seqs):
    _decode_both_ways(_decoder(checkpoints(), dtype), seqs)


def test_plain_nn_linear_layers_bit_for_bit(checkpoints):
    model = load_model(str(checkpoints()), torch.bfloat16, "cpu", progress=False)  # no use_gemv
    assert set(LayerLoop(model).kinds) == {0}  # torch's linear at every row count
    _decode_both_ways(model, 3)


@pytest.mark.parametrize("quant", ["int8", "int4"])
@pytest.mark.parametrize("seqs", [1, 6, 9])
def test_quantized_decoders_bit_for_bit(checkpoints, quant, seqs):
    model = _decoder(checkpoints(), torch.bfloat16, quant)
    assert LayerLoop(model).kinds[0] == (2 if quant == "int8" else 3)
    _decode_both_ways(model, seqs)


@pytest.mark.parametrize("quant", [None, "int8"])
def test_qkv_bias_and_a_tied_head(checkpoints, quant):
    model = _decoder(checkpoints("Qwen2ForCausalLM"), torch.bfloat16, quant)
    assert model.layers[0].self_attn.qkv_proj.bias is not None
    _decode_both_ways(model, 2)


def test_sliding_window_past_its_width(checkpoints):
    model = _decoder(checkpoints("MistralForCausalLM", sliding_window=6), torch.float32)
    assert LayerLoop(model).sliding_windows == [6] * model.num_layers
    _decode_both_ways(model, 2, steps=5)  # 5 prompt tokens + 5 decoded: the window cuts the first ones


def test_sequences_without_a_query_are_skipped(checkpoints):
    _decode_both_ways(_decoder(checkpoints(), torch.bfloat16), 3, counts=[1, 0, 1])


def test_steps_it_does_not_take_return_none(checkpoints, monkeypatch):
    model = _decoder(checkpoints(), torch.bfloat16)
    run, loop = Run(model, 2), LayerLoop(model)
    with torch.inference_mode():
        ids, positions, caches, meta = run.step([2, 1])  # a prefill chunk beside a decode row
        assert loop(model.embed(ids), positions, caches, meta) is None
        ids, positions, caches, meta = run.step([1, 1], backend="reference")
        assert loop(model.embed(ids), positions, caches, meta) is None
        monkeypatch.setenv(decode.ENV, "0")
        ids, positions, caches, meta = run.step([1, 1])
        assert loop(model.embed(ids), positions, caches, meta) is None
        monkeypatch.setenv(decode.ENV, "auto")
        ids, positions, caches, meta = run.step([1, 1])
        assert loop(model.embed(ids), positions, caches, meta) is not None


def test_a_bad_position_or_slot_raises_before_anything_is_written(checkpoints):
    model = _decoder(checkpoints(), torch.bfloat16)
    run, loop = Run(model, 2), LayerLoop(model)
    ids, positions, caches, meta = run.step([1, 1])
    before = _clone(caches)
    with torch.inference_mode():
        with pytest.raises(IndexError, match="token 1 has position 100000"):
            loop(model.embed(ids), torch.tensor([7, 100_000]), caches, meta)
        meta.slot_mapping = torch.tensor([3, 10_000])
        with pytest.raises(IndexError, match="token 1 has slot 10000"):
            loop(model.embed(ids), positions, caches, meta)
    for (k, v), (k0, v0) in zip(caches, before, strict=True):
        assert torch.equal(k, k0) and torch.equal(v, v0)


def test_two_queries_in_one_sequence_are_refused(checkpoints):
    model = _decoder(checkpoints(), torch.bfloat16)
    run = Run(model, 2)
    ids, positions, caches, meta = run.step([2, 1])
    meta.max_seqlen_q = 1  # lying: the op's own check catches it
    with torch.inference_mode(), pytest.raises(RuntimeError, match="sequence 0 has 2 queries"):
        LayerLoop(model)(model.embed(ids), positions, caches, meta)


@pytest.mark.parametrize("arch, overrides, reason", [
    ("Qwen3ForCausalLM", {}, "per-head q/k norms"),
    ("LlamaForCausalLM", {"num_attention_heads": 8, "num_key_value_heads": 2}, "head_dim 8"),
])
def test_decoders_it_does_not_take_keep_the_python_layers(checkpoints, arch, overrides, reason):
    model = _decoder(checkpoints(arch, **overrides), torch.float32)
    assert reason in (unsupported_reason(model) or "")
    assert use_layer_loop(model) is False and model.layer_loop is None
    with pytest.raises(ValueError, match="cannot run this decoder"):
        LayerLoop(model)


def test_an_engine_gives_the_same_tokens_and_logprobs_with_and_without_it(checkpoints):
    llm = LLM(str(checkpoints()), dtype="bfloat16", num_kv_blocks=48, max_num_seqs=4)
    model = llm.engine.model
    loop = model.layer_loop
    assert isinstance(loop, LayerLoop)
    prompts = [{"prompt_token_ids": list(range(3 + i, 12 + 2 * i))} for i in range(5)]
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=2, ignore_eos=True)
    on = llm.generate(prompts, params, use_tqdm=False)
    model.layer_loop = None
    off = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(on, off, strict=True):
        assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
        assert a.outputs[0].logprobs == b.outputs[0].logprobs  # bit for bit: the same floats
