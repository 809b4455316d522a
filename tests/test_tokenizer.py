"""Tokenizer: round trips, special tokens, chat templates (and their sandbox), against transformers."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchinfer.workers.models.tiny import BOS, EOS, EOT, PAD, make_tiny_model
from batchinfer.workers.text.tokenizer import ChatTemplateError, Tokenizer, validate_messages

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "héllo 世界 🙂"},
    {"role": "assistant", "content": "Hi!"},
    {"role": "user", "content": [{"type": "text", "text": "And "}, {"type": "text", "text": "now?"}]},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tok") / "m")


@pytest.fixture(scope="module")
def tok(model_dir) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


def test_round_trip_multibyte(tok):
    text = "héllo 世界 🙂 the quick brown fox"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode("utf-8"))  # merges make some tokens multi-byte
    assert any(len(tok.backend.id_to_token(i)) > 1 for i in ids)


@settings(max_examples=50, deadline=None)
@given(st.text(max_size=40))
def test_round_trip_any_text(tok, text):
    # Special tokens' text in the input becomes the special token (as in transformers), hence
    # skip_special_tokens=False for an exact round trip.
    assert tok.decode(tok.encode(text, add_special_tokens=False), skip_special_tokens=False) == text


def test_special_tokens(tok):
    bos = tok.backend.token_to_id(BOS)
    ids = tok.encode("hello")
    assert ids[0] == bos and ids.count(bos) == 1
    assert tok.encode("hello", add_special_tokens=False) == ids[1:]
    assert tok.bos_token_id == bos
    assert tok.pad_token_id == tok.backend.token_to_id(PAD)
    # generation_config lists end_of_text and eot; tokenizer_config's eos is end_of_text.
    assert tok.eos_token_ids == [tok.backend.token_to_id(EOS), tok.backend.token_to_id(EOT)]
    assert set(tok.eos_token_ids) | {bos} <= set(tok.all_special_ids)
    assert tok.vocab_size == 320
    with_special = [bos, *tok.encode("hi", add_special_tokens=False), tok.eos_token_ids[1]]
    assert tok.decode(with_special) == "hi"
    assert tok.decode(with_special, skip_special_tokens=False) == f"{BOS}hi{EOT}"


def test_add_bos_token_from_config(model_dir):
    """A tokenizer.json without a BOS post-processor gets BOS from tokenizer_config's add_bos_token."""
    data = json.loads((model_dir / "tokenizer.json").read_text())
    data["post_processor"] = None
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    plain = Tokenizer.from_files(json.dumps(data), json.dumps(config))
    bos = plain.bos_token_id
    assert plain.encode("hi")[0] != bos
    config["add_bos_token"] = True
    with_bos = Tokenizer.from_files(json.dumps(data).encode(), json.dumps(config).encode())
    assert with_bos.encode("hi") == [bos, *plain.encode("hi")]


def test_from_files_matches_from_dir(model_dir, tok):
    other = Tokenizer.from_files((model_dir / "tokenizer.json").read_bytes(),
                                 (model_dir / "tokenizer_config.json").read_bytes(),
                                 (model_dir / "generation_config.json").read_bytes())
    assert other.encode("héllo 世界") == tok.encode("héllo 世界")
    assert other.eos_token_ids == tok.eos_token_ids
    assert other.apply_chat_template(CHAT) == tok.apply_chat_template(CHAT)


def test_chat_template(tok):
    text = tok.apply_chat_template(CHAT)
    assert text == (f"{BOS}<|system|>\nBe brief.{EOT}\n<|user|>\nhéllo 世界 🙂{EOT}\n"
                    f"<|assistant|>\nHi!{EOT}\n<|user|>\nAnd now?{EOT}\n<|assistant|>\n")
    assert not tok.apply_chat_template(CHAT, add_generation_prompt=False).endswith("<|assistant|>\n")
    ids = tok.apply_chat_template(CHAT, tokenize=True)
    assert ids == tok.encode(text, add_special_tokens=False)
    assert ids.count(tok.bos_token_id) == 1  # the template writes BOS; encoding must not add another


def test_matches_transformers(model_dir, tok):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(model_dir)
    for text in ["héllo 世界 🙂", "The quick brown fox", "  spaces\n\tand tabs"]:
        assert tok.encode(text) == hf.encode(text)
        assert tok.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
    assert tok.apply_chat_template(CHAT[:3]) == hf.apply_chat_template(
        CHAT[:3], add_generation_prompt=True, tokenize=False)


def test_template_helpers_and_kwargs():
    template = ("{% if not messages[0].content %}{{ raise_exception('empty first message') }}{% endif %}"
                "{{ messages | tojson }}|{{ strftime_now('%Y') | length }}|{{ greeting }}"
                "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
                "{% generation %}{{ m.role }}{% endgeneration %}{% endfor %}")
    tok = Tokenizer.from_files(_tokenizer_json(), chat_template=template)
    out = tok.apply_chat_template([{"role": "user", "content": "é"}, {"role": "x", "content": "y"}],
                                  greeting="hi")
    assert out == '[{"role": "user", "content": "é"}, {"role": "x", "content": "y"}]|4|hiuser'
    with pytest.raises(ChatTemplateError, match="empty first message"):
        tok.apply_chat_template([{"role": "user", "content": ""}])


def test_unknown_role_raises_from_template(tok):
    with pytest.raises(ChatTemplateError, match="unknown role: wizard"):
        tok.apply_chat_template([{"role": "wizard", "content": "hi"}])


@pytest.mark.parametrize("template", [
    "{{ messages.__class__.__mro__[1].__subclasses__() }}",
    "{{ ''.__class__.__base__.__subclasses__() }}",
    "{{ raise_exception.__globals__['__builtins__'] }}",
    "{% set x = messages.append({'role': 'evil'}) %}",
    "{{ 'a' * 10**11 }}",  # memory exhaustion: jinja2 bounds range() but not '*'
    "{{ [0] * 100000000 }}",
    "{{ 7 ** 100000 }}",
])
def test_sandbox_escape_is_rejected(template):
    tok = Tokenizer.from_files(_tokenizer_json(), chat_template=template)
    with pytest.raises(ChatTemplateError, match="unsafe"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_modest_repetition_still_renders():
    tok = Tokenizer.from_files(_tokenizer_json(), chat_template="{{ '=' * 3 }}{{ 2 ** 10 }}")
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "===1024"


def test_template_syntax_error_names_line():
    tok = Tokenizer.from_files(_tokenizer_json(), chat_template="line one\n{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="line 2"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_no_template():
    tok = Tokenizer.from_files(_tokenizer_json())
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(("messages", "error"), [
    ("hello", r"messages: expected a non-empty list"),
    ([], r"messages: expected a non-empty list"),
    (["hi"], r"messages\[0\]: expected an object"),
    ([{"content": "hi"}], r"messages\[0\]\.role"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": 3}], r"messages\[1\]\.content"),
    ([{"role": "user"}], r"messages\[0\]\.content: missing"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], r"messages\[0\]\.content\[0\]: only text"),
    ([{"role": "user", "content": [{"type": "text", "text": 1}]}], r"messages\[0\]\.content\[0\]\.text"),
])
def test_message_validation(messages, error):
    with pytest.raises(ValueError, match=error):
        validate_messages(messages)


def test_tool_call_message_may_omit_content():
    out = validate_messages([{"role": "assistant", "tool_calls": [{"id": "1"}]}])
    assert out[0]["content"] is None and out[0]["tool_calls"] == [{"id": "1"}]


def test_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_files("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json: invalid JSON at line 2"):
        Tokenizer.from_files(_tokenizer_json(), '{\n  "bos_token": }')


def test_chat_template_jinja_file_and_named_templates(model_dir, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((model_dir / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    assert Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}]) == "[x]"
    config = {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}
    assert Tokenizer.from_files(_tokenizer_json(), json.dumps(config)).chat_template == "D"


def test_named_templates_without_default_name_the_others_even_unnamed():
    # an entry without a name (None) once made sorting the names fail with a TypeError
    config = {"chat_template": [{"name": "tool_use", "template": "T"}, {"template": "U"}]}
    with pytest.raises(ValueError, match=r"no 'default' among \[None, 'tool_use'\]"):
        Tokenizer.from_files(_tokenizer_json(), json.dumps(config))


def _tokenizer_json() -> str:
    from batchinfer.workers.models.tiny import build_tokenizer

    return build_tokenizer().to_str()
