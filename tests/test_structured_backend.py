"""The grammar backends (llguidance, xgrammar) against the contract in ``structured/backend.py``, on the
tiny models' tokenizer (byte-level BPE, 312 tokens + 8 special ones: vocab 320).

Allowed sets are checked by decoding: the expected set is computed from each token's own bytes
(what the grammar's language allows next), then compared with the backend's mask.
"""

from __future__ import annotations

import importlib.util
import threading

import pytest
import torch

from batchinfer.workers.models.tiny import EOS, EOT, tokenizer_files
from batchinfer.workers.structured.backend import GrammarBackend, StructuredOutputError, closed_objects
from batchinfer.workers.structured.bitmask import apply_bitmask, unpack_bitmask
from batchinfer.workers.structured.factory import make_backend
from batchinfer.workers.structured_params import StructuredLimits, StructuredOutputsParams
from batchinfer.workers.text.tokenizer import Tokenizer

P = StructuredOutputsParams
V = 320
BACKEND_NAMES = [
    "llguidance",
    pytest.param("xgrammar", marks=pytest.mark.skipif(importlib.util.find_spec("xgrammar") is None,
                                                      reason="xgrammar is not installed")),
]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 130}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    f = tokenizer_files()
    return Tokenizer.from_files(f["tokenizer.json"], f["tokenizer_config.json"], f["generation_config.json"])


@pytest.fixture(scope="module")
def eos(tok) -> list[int]:
    ids = tok.eos_token_ids
    assert ids == [tok.backend.token_to_id(EOS), tok.backend.token_to_id(EOT)]
    return ids


@pytest.fixture(scope="module", params=BACKEND_NAMES)
def name(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def backend(name, tok, eos) -> GrammarBackend:
    return make_backend(name, tok, V, eos)


def token_bytes(tok: Tokenizer, t: int) -> bytes:
    """The token's own bytes; b"" for special tokens (they are never text)."""
    if t in tok.all_special_ids or t >= tok.vocab_size:
        return b""
    return tok.decode_token(t)[1]


def allowed(backend: GrammarBackend, matcher, width: int | None = None) -> set[int]:
    mask = backend.allocate_bitmask(1)
    backend.fill_bitmask([(matcher, 0)], mask)
    return set(unpack_bitmask(mask, width or backend.vocab_size)[0].nonzero().flatten().tolist())


def expected(tok: Tokenizer, ok) -> set[int]:
    """Token ids whose bytes ``ok(bytes)`` accepts (non-empty, non-special)."""
    return {t for t in range(tok.vocab_size) if (b := token_bytes(tok, t)) and ok(b)}


def feed(matcher, tok: Tokenizer, text: str) -> None:
    for t in tok.encode(text, add_special_tokens=False):
        assert matcher.accept(t), (text, t, matcher.error)


# -- masks ---------------------------------------------------------------------------------------

def test_choice_mask(backend, tok, eos):
    m = backend.matcher(backend.compile(P(choice=["yes", "no"])))
    want = expected(tok, lambda b: b"yes".startswith(b) or b"no".startswith(b))
    assert {tok.decode([t]) for t in want} >= {"y", "n"}
    assert allowed(backend, m) == want  # no EOS yet: "" is not a choice
    feed(m, tok, "ye")
    assert allowed(backend, m) == expected(tok, lambda b: b"s".startswith(b))


def test_regex_mask(backend, tok, eos):
    m = backend.matcher(backend.compile(P(regex="[0-9]{1,3}")))
    digits = expected(tok, lambda b: b.isdigit() and len(b) <= 3)
    assert allowed(backend, m) == digits
    feed(m, tok, "12")
    assert allowed(backend, m) == expected(tok, lambda b: b.isdigit() and len(b) == 1) | set(eos)
    feed(m, tok, "3")
    assert allowed(backend, m) == set(eos)


def test_json_masks(backend, tok):
    m = backend.matcher(backend.compile(P(json={"type": "object", "properties": {"ok": {"type": "boolean"}},
                                               "required": ["ok"], "additionalProperties": False})))
    feed(m, tok, '{"ok":')
    assert allowed(backend, m) == expected(tok, lambda b: b"true".startswith(b) or b"false".startswith(b))
    m = backend.matcher(backend.compile(P(json={"type": "string"})))
    feed(m, tok, '"ab')
    inside = allowed(backend, m)
    assert inside and not inside & set(tok.all_special_ids)  # <|eot|> is never string content
    texts = [token_bytes(tok, t) for t in inside]
    assert all(b'"' not in b[:-1] for b in texts)  # a quote ends the string: nothing after it
    assert tok.encode('"', add_special_tokens=False)[0] in inside


@pytest.mark.parametrize("schema", [{"type": "string"}, {"type": "string", "maxLength": 6}])
def test_json_strings_hold_only_valid_text(backend, tok, schema):
    """No raw control character, no UTF-16 surrogate (bytes ED A0-BF): JSON parsers reject both
    (xgrammar 0.2.9's own masks allow them; its backend filters them out)."""
    def byte_token(b: int) -> int:
        return next(t for t in range(tok.vocab_size) if token_bytes(tok, t) == bytes([b]))

    m = backend.matcher(backend.compile(P(json=schema)))
    feed(m, tok, '"a')
    mask = allowed(backend, m)
    assert mask & expected(tok, lambda b: b.isalpha())
    assert not mask & expected(tok, lambda b: any(c < 0x20 for c in b))
    assert not m.accept(byte_token(0x1C)) and m.error
    m = backend.matcher(backend.compile(P(json=schema)))
    feed(m, tok, '"')
    assert m.accept(byte_token(0xED))  # the lead byte of U+D000-U+DFFF
    after = allowed(backend, m)
    assert byte_token(0x80) in after and byte_token(0x9F) in after  # U+D000-U+D7FF: valid
    assert not after & {byte_token(b) for b in range(0xA0, 0xC0)}  # surrogates
    assert not m.accept(byte_token(0xA0))
    m = backend.matcher(backend.compile(P(json=schema)))
    feed(m, tok, '"')
    assert m.accept(byte_token(0xED)) and m.accept(byte_token(0x80))
    m.rollback(1)  # back to just after ED: the surrogate rule applies again
    assert not m.accept(byte_token(0xBF))


def test_json_object_and_compact_whitespace(backend, tok):
    m = backend.matcher(backend.compile(P(json_object=True)))
    assert allowed(backend, m) == expected(tok, lambda b: b.startswith(b"{"))
    m = backend.matcher(backend.compile(P(json=PERSON)))
    feed(m, tok, '{"name":"a"')
    # Compact by default: "," next, no space; a space is allowed with disable_any_whitespace=False.
    assert allowed(backend, m) == expected(tok, lambda b: b",".startswith(b) or b.startswith(b',"'))
    loose = backend.matcher(backend.compile(P(json=PERSON, disable_any_whitespace=False)))
    feed(loose, tok, '{"name":"a"')
    assert tok.encode(" ", add_special_tokens=False)[0] in allowed(backend, loose)


@pytest.mark.parametrize("grammar", ['start: "a" ("b" | "cd")', 'root ::= "a" ("b" | "cd")'],
                         ids=["lark", "ebnf"])
def test_grammar_masks(backend, tok, eos, grammar):
    m = backend.matcher(backend.compile(P(grammar=grammar)))
    assert allowed(backend, m) == expected(tok, lambda b: any(w.startswith(b) for w in (b"ab", b"acd")))
    feed(m, tok, "a")
    feed(m, tok, "c")
    assert allowed(backend, m) == expected(tok, lambda b: b == b"d")
    feed(m, tok, "d")
    assert m.is_terminated and allowed(backend, m) == set(eos)


def test_choice_strings_are_literal(backend, tok):
    choices = ['a"b', "x|y", "(1+2)*3", "back\\slash", "[z]"]
    compiled = backend.compile(P(choice=choices))
    for c in choices:
        m = backend.matcher(compiled)
        feed(m, tok, c)
        assert m.is_accepting and m.is_terminated, c
    m = backend.matcher(compiled)
    x = tok.encode("x", add_special_tokens=False)[0]
    assert m.accept(x) and not m.accept(tok.encode("y", add_special_tokens=False)[0])  # "|" is not "or"


# -- accept / reject / rollback ------------------------------------------------------------------

def test_reject_sets_error(backend, tok, eos):
    m = backend.matcher(backend.compile(P(regex="ab")))
    a, b = (tok.encode(c, add_special_tokens=False)[0] for c in "ab")
    assert m.error is None
    assert not m.accept(eos[0])  # EOS where the grammar cannot end
    assert m.error and isinstance(m.error, str)
    m = backend.matcher(backend.compile(P(regex="ab")))
    assert m.accept(a) and not m.accept(a)
    assert "a" in m.error
    assert not m.accept(b)  # unusable after a rejection


def test_rollback_restores_state(backend, tok, eos):
    m = backend.matcher(backend.compile(P(json=PERSON)))
    feed(m, tok, '{"name":"')
    before = allowed(backend, m)
    ids = tok.encode('ab","age":1', add_special_tokens=False)
    for t in ids:
        assert m.accept(t)
    assert allowed(backend, m) != before
    m.rollback(len(ids))
    assert allowed(backend, m) == before
    m.rollback(0)
    assert allowed(backend, m) == before
    # Across the end: completed and terminated, then back.
    c = backend.matcher(backend.compile(P(choice=["no"])))
    feed(c, tok, "n")
    mid = allowed(backend, c)
    feed(c, tok, "o")
    assert c.is_terminated and c.accept(eos[0])
    c.rollback(2)
    assert not c.is_terminated and not c.is_accepting and allowed(backend, c) == mid


def test_rollback_past_the_start_raises(backend, tok):
    m = backend.matcher(backend.compile(P(regex="[a-z]+")))
    feed(m, tok, "a")
    with pytest.raises(RuntimeError, match="roll back 5"):
        m.rollback(5)


# -- forced tokens (jump-forward) ----------------------------------------------------------------

def test_forced_tokens_fixed_keys(backend, tok):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                               "id": {"type": "integer"}},
              "required": ["name", "id"], "additionalProperties": False}
    m = backend.matcher(backend.compile(P(json=schema)))
    forced = m.forced_tokens()
    text = tok.decode(forced)
    assert len(forced) >= 3 and '{"name":"'.startswith(text), text
    assert forced == tok.encode(text, add_special_tokens=False)  # the tokenizer's own tokenization
    for t in forced:
        assert m.accept(t)
    feed(m, tok, '{"name":"'[len(text):])
    assert m.forced_tokens() == []  # inside a free string: a choice
    feed(m, tok, 'ab"')
    forced = m.forced_tokens()
    assert forced and ',"id":'.startswith(tok.decode(forced)), tok.decode(forced)
    assert m.forced_tokens() == forced  # asking does not advance the matcher


def test_forced_tokens_never_split_what_the_tokenizer_merges(backend, tok):
    """Forced " the " must not end with the lone space token: the tokenizer writes " the quick" as
    "Ġthe" "Ġqu" "ick" (the space merges with what follows), so only "Ġthe" is safe to force."""
    choices = [" the quick", " the worker"]
    m = backend.matcher(backend.compile(P(choice=choices)))
    forced = m.forced_tokens()
    assert forced, "the common prefix is forced"
    for c in choices:
        assert tok.encode(c, add_special_tokens=False)[:len(forced)] == forced, (c, forced)


def test_forced_tokens_are_empty_where_there_is_a_choice(backend, tok):
    m = backend.matcher(backend.compile(P(choice=["yes", "no"])))
    assert m.forced_tokens() == []
    feed(m, tok, "y")
    forced = m.forced_tokens()
    assert tok.decode(forced) in ("", "e", "es")  # "es" is forced; a backend may keep back the end


# -- termination and EOS --------------------------------------------------------------------------

def test_termination(backend, tok, eos):
    m = backend.matcher(backend.compile(P(json=PERSON)))
    feed(m, tok, '{"name":"Al","age":4')
    assert m.is_accepting is False and m.is_terminated is False
    feed(m, tok, "2}")
    assert m.is_accepting and m.is_terminated  # nothing may follow but EOS
    assert allowed(backend, m) == set(eos)
    assert m.forced_tokens() == []
    assert m.accept(eos[1])  # either EOS id
    assert m.is_terminated and allowed(backend, m) == set(eos)  # still a valid (stop-only) mask
    # Accepting but not terminated: more digits may follow, or EOS.
    r = backend.matcher(backend.compile(P(regex="[0-9]+")))
    feed(r, tok, "7")
    assert r.is_accepting and not r.is_terminated
    assert set(eos) <= allowed(backend, r)
    assert r.accept(eos[0]) and r.is_terminated


# -- vocabulary padding ---------------------------------------------------------------------------

@pytest.mark.parametrize("model_vocab", [330, 352])
def test_model_vocab_larger_than_tokenizer(name, tok, eos, model_vocab):
    backend = make_backend(name, tok, model_vocab, eos)
    mask = backend.allocate_bitmask(3)
    assert mask.shape == (3, (model_vocab + 31) // 32) and mask.dtype == torch.int32
    free = backend.matcher(backend.compile(P(json={"type": "string"})))
    feed(free, tok, '"x')
    done = backend.matcher(backend.compile(P(regex="a")))
    feed(done, tok, "a")
    start = backend.matcher(backend.compile(P(json_object=True)))
    backend.fill_bitmask([(free, 0), (done, 1), (start, 2)], mask)
    bits = unpack_bitmask(mask, model_vocab)
    assert not bits[:, V:].any()  # padding ids are never allowed
    assert bits[0, :V].sum() > 100
    assert set(bits[1].nonzero().flatten().tolist()) == set(eos)
    assert not free.accept(model_vocab - 1)


def sentencepiece_tokenizer() -> tuple[Tokenizer, list[str]]:
    """A Llama-2-style byte-fallback BPE: "▁" for a space, a prepended "▁", <0xNN> byte pieces."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers

    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "▁", "h", "i", "▁h", "▁hi"]
    hf = HFTokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[("▁", "h"), ("▁h", "i")],
                                unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    hf.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    hf.add_special_tokens(["<s>", "</s>"])
    return Tokenizer(hf, {"eos_token": "</s>", "bos_token": "<s>"}), pieces


def test_byte_fallback_vocabulary(name):
    """Byte pieces and "▁" decode to their bytes; forced text is tokenized as a continuation
    (no prepended space): " hi\n" is "▁hi" "<0x0A>", not "▁" "▁hi" ..."""
    tok, pieces = sentencepiece_tokenizer()
    backend = make_backend(name, tok, len(pieces), tok.eos_token_ids)
    m = backend.matcher(backend.compile(P(regex=" hi\n")))
    assert pieces.index("▁hi") in allowed(backend, m)
    assert [pieces[t] for t in m.forced_tokens()] == ["▁hi", "<0x0A>"]
    assert m.accept(pieces.index("▁hi")) and m.accept(pieces.index("<0x0A>")) and m.is_terminated


# -- errors and limits ----------------------------------------------------------------------------

@pytest.mark.parametrize("params, words", [
    (P(json={"type": "foo"}), ["foo"]),
    (P(json={"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}), ["$defs"]),
    (P(json={"properties": 5}), ["properties"]),
    (P(json={"type": "integer", "minimum": 10, "maximum": 1}), ["minimum", "maximum"]),
    (P(json={"type": "object", "properties": {"x": {"not": {"type": "string"}}}}), ["not"]),
    (P(json={"type": "array", "uniqueItems": True}), ["uniqueItems"]),
    (P(regex="(ab"), []),
    (P(regex="[z-a]"), []),
    (P(grammar='start: "a" | )'), []),
    (P(grammar='root ::= "a" | ('), []),
    (P(grammar="root ::= undefined_rule"), ["undefined_rule"]),
], ids=lambda v: v.kind if isinstance(v, P) else None)
def test_bad_specs(backend, params, words):
    with pytest.raises(StructuredOutputError) as e:
        backend.compile(params)
    message = str(e.value)
    assert message.startswith(f"{params.kind}: ") and len(message) > len(params.kind) + 10, message
    assert "\n" not in message
    for w in words:
        assert w in message, message
    with pytest.raises(StructuredOutputError):  # not cached: asked again, it fails again
        backend.validate(params)


def test_limits(name, tok, eos):
    backend = make_backend(name, tok, V, eos, limits=StructuredLimits(max_spec_bytes=200, max_depth=4,
                                                                      max_choices=3))
    with pytest.raises(StructuredOutputError, match=r"^regex: the regex is \d+ bytes; the limit is 200"):
        backend.compile(P(regex="a" * 300))
    deep = {"type": "object", "properties": {"a": {"type": "object",
                                                   "properties": {"b": {"properties": {"c": {}}}}}}}
    with pytest.raises(StructuredOutputError, match="^json: the schema nests deeper than 4 levels"):
        backend.compile(P(json=deep))
    with pytest.raises(StructuredOutputError, match="^choice: 4 choices; the limit is 3"):
        backend.compile(P(choice=["a", "b", "c", "d"]))
    assert backend.num_compiles == 0


def test_compile_timeout(name, tok, eos):
    """A large schema against a tiny time limit: an error, promptly, and the backend still works."""
    props = {f"field_{i}": {"type": "object", "properties": {
        f"k{j}": {"anyOf": [{"type": "string", "maxLength": 20}, {"type": "integer", "minimum": -5},
                            {"enum": ["a", "b", "c"]}]} for j in range(10)}} for i in range(40)}
    big = P(json={"type": "object", "properties": props, "required": list(props)})
    backend = make_backend(name, tok, V, eos, limits=StructuredLimits(compile_timeout_s=1e-4))
    with pytest.raises(StructuredOutputError, match=r"^json: compiling took longer than the limit of 0.0001"):
        backend.compile(big)
    assert backend.num_compiles == 0
    ok = make_backend(name, tok, V, eos)
    ok.compile(P(json=PERSON))
    ok.compile(big)  # the same schema compiles under the default limit


# -- the compile cache ----------------------------------------------------------------------------

def test_lru_cache(name, tok, eos):
    backend = make_backend(name, tok, V, eos, cache_size=2)
    a, b, c = P(regex="a+"), P(regex="b+"), P(regex="c+")
    first = backend.compile(a)
    assert backend.compile(P(regex="a+")) is first  # an equal spec: a hit
    backend.compile(b)
    backend.compile(a)  # a is now the most recently used
    assert backend.num_compiles == 2
    backend.compile(c)  # evicts b, the least recently used
    assert backend.num_compiles == 3
    backend.compile(a)
    assert backend.num_compiles == 3
    backend.compile(b)
    assert backend.num_compiles == 4
    # The options are part of the key.
    backend.compile(P(json=PERSON))
    backend.compile(P(json=PERSON, disable_any_whitespace=False))
    assert backend.num_compiles == 6
    # Matchers from one compiled grammar are independent.
    m1, m2 = backend.matcher(first), backend.matcher(first)
    feed(m1, tok, "aaa")
    assert m2.is_accepting is False and m1.is_accepting


# -- closed objects -------------------------------------------------------------------------------

def test_closed_objects():
    schema = {
        "type": "object",
        "properties": {
            "inner": {"type": "object", "properties": {"x": {"type": "integer"}}},
            "open": {"type": "object", "additionalProperties": True},
            "properties": {"type": "string"},  # a property named "properties": not a schema keyword
            "nullable": {"type": ["object", "null"]},
            "list": {"type": "array", "items": {"properties": {"y": {}}}},
            "fixed": {"const": {"type": "object", "properties": {}}},  # data: left alone
            "pick": {"enum": [{"properties": {}}]},
        },
        "$defs": {"d": {"type": "object"}},
        "anyOf": [{"type": "object"}],
    }
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    p = closed["properties"]
    assert p["inner"]["additionalProperties"] is False
    assert p["open"]["additionalProperties"] is True
    assert p["properties"] == {"type": "string"}
    assert p["nullable"]["additionalProperties"] is False
    assert p["list"]["items"]["additionalProperties"] is False
    assert p["fixed"] == {"const": {"type": "object", "properties": {}}}
    assert p["pick"] == {"enum": [{"properties": {}}]}
    assert closed["$defs"]["d"]["additionalProperties"] is False
    assert closed["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # a copy
    assert "additionalProperties" not in closed["properties"]  # the properties map is not a schema


def test_disable_additional_properties(backend, tok):
    open_schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    comma = tok.encode(",", add_special_tokens=False)[0]
    brace = tok.encode("}", add_special_tokens=False)[0]
    m = backend.matcher(backend.compile(P(json=open_schema)))
    feed(m, tok, '{"a":1')
    assert {comma, brace} <= allowed(backend, m)  # another key may follow
    strict = backend.matcher(backend.compile(P(json=open_schema, disable_additional_properties=True)))
    feed(strict, tok, '{"a":1')
    mask = allowed(backend, strict)
    assert brace in mask and comma not in mask


# -- bitmasks -------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_bitmask_matches_unpack(dtype):
    gen = torch.Generator().manual_seed(0)
    words = torch.randint(-(2**31), 2**31 - 1, (4, 3), generator=gen, dtype=torch.int64).to(torch.int32)
    words[0] = -1  # all allowed
    words[1] = 0  # none
    words[2, 0] = -(2**31)  # bit 31 alone: the sign bit
    logits = torch.randn(4, 100, generator=gen).to(dtype)  # wider than 32 * 3 = 96 columns
    out = logits.clone()
    apply_bitmask(out, words)
    bits = unpack_bitmask(words, 100)
    assert bits.shape == (4, 100) and not bits[:, 96:].any()
    assert bits[2, :32].tolist() == [False] * 31 + [True]
    torch.testing.assert_close(out, torch.where(bits, logits, torch.tensor(float("-inf"), dtype=dtype)))
    # rows: only those logits rows change, each from its own bitmask row.
    many = torch.randn(6, 90, generator=gen).to(dtype)
    masked = many.clone()
    rows = torch.tensor([4, 1])
    apply_bitmask(masked, words[2:4], rows)
    want = many.clone()
    for i, r in enumerate(rows.tolist()):
        want[r] = torch.where(unpack_bitmask(words[2 + i:3 + i], 90)[0], many[r],
                              torch.tensor(float("-inf"), dtype=dtype))
    torch.testing.assert_close(masked, want)
    assert torch.equal(masked[[0, 2, 3, 5]], many[[0, 2, 3, 5]])


def test_fill_checks_the_bitmask(backend):
    m = backend.matcher(backend.compile(P(regex="a")))
    with pytest.raises(ValueError, match="int32 CPU tensor"):
        backend.fill_bitmask([(m, 0)], torch.zeros((1, 3), dtype=torch.int32))  # 3 words, not 10
    with pytest.raises(ValueError, match="int32 CPU tensor"):
        backend.fill_bitmask([(m, 0)], torch.zeros((1, 10), dtype=torch.int64))
    with pytest.raises(ValueError, match="row 2 is outside"):
        backend.fill_bitmask([(m, 2)], backend.allocate_bitmask(2))


def test_threaded_fill_equals_serial(backend, tok):
    """Two threads filling masks for different matchers at once get what one thread gets."""
    compiled = backend.compile(P(json=PERSON))
    prefixes = ['{"name":"', '{"name":"ab', '{"name":"a","age":', '{"name":"a","age":1', "", '{"na']
    groups = []
    for g in range(2):
        ms = []
        for i in range(12):
            m = backend.matcher(compiled)
            feed(m, tok, prefixes[(i + g) % len(prefixes)])
            ms.append((m, i))
        groups.append(ms)
    serial = []
    for ms in groups:
        mask = backend.allocate_bitmask(12)
        backend.fill_bitmask(ms, mask)
        serial.append(mask)
    results: list[list[torch.Tensor]] = [[], []]

    def work(g: int) -> None:
        for _ in range(30):
            mask = backend.allocate_bitmask(12)
            backend.fill_bitmask(groups[g], mask)
            results[g].append(mask)

    threads = [threading.Thread(target=work, args=(g,)) for g in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for g in range(2):
        assert len(results[g]) == 30
        for mask in results[g]:
            assert torch.equal(mask, serial[g])


@pytest.mark.gpu
@pytest.mark.parametrize("mask_on_gpu", [False, True])
def test_apply_bitmask_cuda_matches_cpu(mask_on_gpu):
    """Logits on the GPU, the bitmask from the CPU (as the engine fills it) or already on the GPU."""
    gen = torch.Generator().manual_seed(1)
    words = torch.randint(-(2**31), 2**31 - 1, (3, 1536), generator=gen, dtype=torch.int64).to(torch.int32)
    logits = torch.randn(5, 49157, generator=gen)  # a padded vocabulary, wider than 32 * 1536
    rows = torch.tensor([4, 0, 2])
    want = logits.clone()
    apply_bitmask(want, words, rows)
    got = logits.cuda()
    apply_bitmask(got, words.cuda() if mask_on_gpu else words, rows)
    torch.testing.assert_close(got.cpu(), want)
    assert torch.isinf(got[[4, 0, 2], 49152:]).all() and not torch.isinf(got[[1, 3]]).any()


def test_first_allowed_is_the_lowest_allowed_token_eos_aside():
    from batchinfer.workers.structured.bitmask import first_allowed

    mask = torch.zeros(2, 3, dtype=torch.int32)  # 96 bit positions over a 70-token vocabulary
    assert first_allowed(mask[0], 70) is None
    mask[0, 1] = (1 << 3) | (1 << 9)  # tokens 35 and 41
    assert first_allowed(mask[0], 70) == 35 and first_allowed(mask[0], 70, exclude=[35]) == 41
    assert first_allowed(mask[0], 70, exclude=[35, 41]) is None
    mask[1, 2] = -(2**31)  # bit 31 of word 2: token 95, past the vocabulary
    assert first_allowed(mask[1], 70) is None and first_allowed(mask[1], 96) == 95
