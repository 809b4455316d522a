"""Embedding models against the references: sentence-transformers' ``encode`` vectors, transformers'
hidden states and tokenizers, on tiny random BERT / RoBERTa / XLM-R / Qwen3Model folders and
(slow) the real all-MiniLM-L6-v2."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_embedders import EMBEDDING_KINDS, make_tiny_embedding_model

from batchinfer import LLM
from batchinfer.workers.models.bert import EncoderConfig, load_encoder
from batchinfer.workers.models.demo import minilm_model
from batchinfer.workers.text.tokenizer import Tokenizer
from batchinfer.workers.text.tokenizer_files import read_tokenizer_files

transformers = pytest.importorskip("transformers")
sentence_transformers = pytest.importorskip("sentence_transformers")

MIN_COSINE = 0.9999
WORDS = " ".join((
    "the quick brown fox jumps over lazy dog hello world engine schedules requests in batches",
    "each request has a prompt and model generates tokens until it stops cache scheduler worker",
    "queue embeddings map sentences to vectors search compares query document Café naïve résumé",
    "42 1999 3.14 questions? Yes: often!")).split(" ")


def texts_of_lengths(tokenizer: Tokenizer, lengths: list[int], seed: int = 0) -> list[str]:
    """Texts of about ``lengths`` tokens each (special tokens included), from a fixed word list."""
    rng = random.Random(seed)
    out = []
    for n in lengths:
        words: list[str] = []
        while len(tokenizer.encode(" ".join(words))) < n:
            words.append(rng.choice(WORDS))
        out.append(" ".join(words))
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("embedders")
    return {kind: make_tiny_embedding_model(root / kind, kind) for kind in EMBEDDING_KINDS}


def cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1)


@pytest.mark.parametrize("kind", EMBEDDING_KINDS)
def test_vectors_match_sentence_transformers(folders: dict[str, Path], kind: str) -> None:
    """Mixed lengths 8..200 through a 256-token step budget: several steps, sequences packed."""
    folder = folders[kind]
    llm = LLM(model=str(folder), max_num_batched_tokens=256, max_num_seqs=8)
    lengths = [8, 200, 13, 64, 31, 150, 9, 100, 47, 180, 8, 77, 120, 25]
    texts = texts_of_lengths(llm.get_tokenizer(), lengths)
    steps_before = llm.engine.num_steps
    outs = llm.embed(texts)
    assert llm.engine.num_steps - steps_before >= 5  # ~1,000 tokens through 256-token steps
    ours = torch.tensor([o.outputs.embedding for o in outs])
    ref = sentence_transformers.SentenceTransformer(str(folder), device="cpu").encode(
        texts, convert_to_tensor=True).float()
    assert ours.shape == ref.shape == (len(texts), 64)
    cos = cosines(ours, ref)
    assert cos.min() >= MIN_COSINE, f"{kind}: smallest cosine {cos.min():.6f}"
    torch.testing.assert_close(ours, ref, rtol=1e-3, atol=1e-4)
    # The vectors differ from one text to the next: the model is not degenerate.
    assert cosines(ours[:-1], ours[1:]).max() < 0.99


@pytest.mark.parametrize("kind", ["bert", "roberta", "qwen3"])
def test_token_ids_match_transformers(folders: dict[str, Path], kind: str) -> None:
    """Ours from the folder and from the files a worker registers (the scheduler's copy) vs AutoTokenizer."""
    folder = folders[kind]
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    files = read_tokenizer_files(folder)
    ours = [Tokenizer.from_dir(folder),
            Tokenizer.from_files(files["tokenizer.json"], files.get("tokenizer_config.json"))]
    texts = ["Hello world!", "The QUICK brown fox, jumps over: the lazy dog?", "Café naïve résumé 3.14",
             "unknownwordpiece zzz", " ".join(WORDS) * 4, "x"]
    for tok in ours:
        for text in texts:
            assert tok.encode(text) == hf(text)["input_ids"], text
    assert len(ours[0].encode(" ".join(WORDS) * 4)) > 128  # the file's padding / truncation: not applied


@pytest.mark.parametrize("kind", ["bert", "roberta", "xlm-roberta"])
def test_encoder_hidden_states_match_transformers(folders: dict[str, Path], kind: str) -> None:
    """Packed sequences (one holding the pad id, RoBERTa numbers as padding) vs AutoModel one by one."""
    folder = folders[kind]
    model = load_encoder(folder)
    hf = transformers.AutoModel.from_pretrained(str(folder), attn_implementation="eager").eval()
    pad = model.config.pad_token_id
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(5, model.config.vocab_size, (n,), generator=gen) for n in (1, 7, 40, 130)]
    seqs[2][5] = pad
    ids = torch.cat(seqs)
    cu = torch.tensor([0, *torch.tensor([len(s) for s in seqs]).cumsum(0).tolist()], dtype=torch.int32)
    positions = torch.cat([torch.arange(len(s)) for s in seqs])
    with torch.inference_mode():
        ours = model(ids, positions, cu)
        for i, s in enumerate(seqs):
            mask = torch.ones(1, len(s), dtype=torch.long)
            ref = hf(input_ids=s[None], attention_mask=mask).last_hidden_state[0]
            torch.testing.assert_close(ours[cu[i]:cu[i + 1]], ref, rtol=1e-4, atol=1e-4)


def test_bert_prefixed_names_and_loader_errors(folders: dict[str, Path], tmp_path: Path) -> None:
    folder = folders["bert"]
    base = load_encoder(folder)
    copy = tmp_path / "prefixed"
    copy.mkdir()
    for f in folder.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            (copy / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({f"bert.{n}": t for n, t in tensors.items()}, str(copy / "model.safetensors"))
    prefixed = load_encoder(copy)
    for (name, a), (_, b) in zip(base.state_dict().items(), prefixed.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    kept = {n: t for n, t in tensors.items() if "layer.1.output.dense" not in n}
    save_file(kept, str(copy / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks tensors for layers\.1\.down\.bias"):
        load_encoder(copy)
    save_file({**tensors, "embeddings.extra.weight": torch.zeros(2)}, str(copy / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected tensor 'embeddings.extra.weight'"):
        load_encoder(copy)


def test_unsupported_encoder_configs_are_refused() -> None:
    base = json.loads('{"architectures": ["BertModel"], "vocab_size": 10, "hidden_size": 8, '
                      '"num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 16}')
    assert EncoderConfig.from_dict(base).max_len == 512
    assert EncoderConfig.from_dict({**base, "architectures": ["XLMRobertaModel"],
                                    "max_position_embeddings": 514, "pad_token_id": 1}).max_len == 512
    with pytest.raises(ValueError, match="encoder architecture DebertaModel; supported: BertModel"):
        EncoderConfig.from_dict({**base, "architectures": ["DebertaModel"]})
    with pytest.raises(ValueError, match="position_embedding_type 'relative_key'"):
        EncoderConfig.from_dict({**base, "position_embedding_type": "relative_key"})
    with pytest.raises(ValueError, match="hidden_act 'relu'"):
        EncoderConfig.from_dict({**base, "hidden_act": "relu"})


# -- the real model ---------------------------------------------------------------------------------

SENTENCES = [
    "A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby.",
    "A man is riding a horse.", "A woman is playing violin.", "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.", "A monkey is playing drums.",
    "Someone in a gorilla costume is playing a set of drums.", "The cat sits on the mat.",
    "The new movie is awesome.", "The new movie is so great.", "How do I reset my password?",
    "What is the procedure to change my password?", "The stock market fell sharply on Monday.",
    "Shares tumbled at the start of the week.", "I love pizza with extra cheese.",
    "Quantum computers use qubits instead of bits.", "Paris is the capital of France.",
    "The Eiffel Tower is in Paris.", "Photosynthesis converts light into chemical energy.",
    "He scored the winning goal in the final minute.", "The train was delayed by an hour.",
    "Our flight got cancelled because of the storm.", "Please submit the report by Friday.",
    "Water boils at 100 degrees Celsius at sea level.", "She adopted a puppy from the shelter.",
    "The library opens at nine in the morning.", "Machine learning models need lots of data.",
    "Embeddings place similar sentences near each other. " * 12,  # ~120 tokens
]


def minilm_dir() -> Path:
    try:
        return minilm_model()  # found, not imported
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.mark.slow
def test_all_minilm_l6_v2_matches_sentence_transformers() -> None:
    folder = minilm_dir()
    llm = LLM(model=str(folder), max_num_batched_tokens=512)
    assert llm.engine.max_model_len == 256  # sentence_bert_config.json's max_seq_length, as vLLM reads it
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    tok = llm.get_tokenizer()
    for s in SENTENCES:
        assert tok.encode(s) == hf(s)["input_ids"], s
    outs = llm.embed(SENTENCES)
    ours = torch.tensor([o.outputs.embedding for o in outs])
    ref = sentence_transformers.SentenceTransformer(str(folder), device="cpu").encode(
        SENTENCES, convert_to_tensor=True).float()
    cos = cosines(ours, ref)
    assert cos.min() >= MIN_COSINE, f"smallest cosine {cos.min():.7f}"
    torch.testing.assert_close(ours.norm(dim=-1), torch.ones(len(SENTENCES)), rtol=1e-5, atol=1e-5)
    sim = ours @ ours.T
    for a, paraphrase, unrelated in ((0, 1, 17), (11, 10, 25), (12, 13, 3), (14, 15, 8), (22, 23, 20)):
        assert sim[a, paraphrase] > sim[a, unrelated] + 0.1, (SENTENCES[a], SENTENCES[paraphrase])
