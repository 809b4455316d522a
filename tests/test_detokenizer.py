"""Incremental detokenisation (multi-byte UTF-8, context-dependent spaces) and stop-string search."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchinfer.workers.models.tiny import EOT, build_tokenizer
from batchinfer.workers.text.detokenizer import IncrementalDetokenizer, find_stop_string

TEXT = "héllo 世界 🙂"


@pytest.fixture(scope="module")
def tok():
    """The byte-level BPE of the tiny test models: non-ASCII text becomes one token per byte."""
    return build_tokenizer()


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def stream(
    tok, ids: list[int], prompt: list[int] | None = None, **kw
) -> tuple[list[str], IncrementalDetokenizer]:
    """Feed ids one by one after a prompt; the deltas and the detokenizer."""
    detok = IncrementalDetokenizer(tok, prompt if prompt is not None else encode(tok, "Hello"), **kw)
    return [detok.append(t) for t in ids], detok


def test_multibyte_text_streams_exactly(tok):
    ids = encode(tok, TEXT)
    assert any("\ufffd" in tok.decode([t]) for t in ids)  # really split inside characters
    deltas, detok = stream(tok, ids)
    assert "".join(deltas) == TEXT == detok.text
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # held back while a character was incomplete
    assert not detok.has_pending and detok.flush() == ""
    # each character appears whole, at the token that completes it
    assert [d for d in deltas if d] == ["h", "é", "llo", " ", "世", "界", " ", "🙂"]


def test_prompt_ending_in_any_text_gives_the_same_output(tok):
    ids = encode(tok, TEXT)
    prompts = [[], encode(tok, "x"), encode(tok, "🙂🙂 long prompt, many tokens"), [tok.token_to_id(EOT)]]
    for prompt in prompts:
        deltas, _ = stream(tok, ids, prompt)
        assert "".join(deltas) == TEXT


@settings(max_examples=150, deadline=None)
@given(prompt=st.text(max_size=20), text=st.text(max_size=40))
def test_streaming_reproduces_any_text(tok, prompt, text):
    ids = encode(tok, text)
    deltas, detok = stream(tok, ids, encode(tok, prompt))
    # text containing U+FFFD itself is held back until a later token or the final flush
    assert "".join(deltas) + detok.flush() == tok.decode(ids) == detok.text
    if "<|" not in text:  # else special-token spellings became special tokens, skipped
        assert detok.text == text


def test_flush_emits_an_incomplete_character_at_the_end(tok):
    ids = encode(tok, "ok 世")[:-1]  # the last byte of 世 never comes
    deltas, detok = stream(tok, ids)
    assert "".join(deltas) == "ok " and detok.has_pending
    assert detok.flush() == "\ufffd"
    assert detok.text == "ok \ufffd" == tok.decode(ids)


def test_special_tokens_skipped_or_kept(tok):
    ids = encode(tok, "Hi") + [tok.token_to_id(EOT)] + encode(tok, " there")
    assert "".join(stream(tok, ids)[0]) == "Hi there"
    assert "".join(stream(tok, ids, skip_special_tokens=False)[0]) == "Hi<|eot|> there"


def test_context_dependent_leading_space():
    """SentencePiece-style decoders drop a leading space when a token is decoded alone."""
    from tokenizers import Tokenizer, decoders, models

    sp = Tokenizer(models.WordLevel({"▁hello": 0, "▁world": 1, "!": 2, "<unk>": 3}, unk_token="<unk>"))
    sp.decoder = decoders.Metaspace()
    assert sp.decode([1]) == "world"  # what naive per-token decoding would give
    deltas, detok = stream(sp, [1, 2, 1], prompt=[0])
    assert deltas == [" world", "!", " world"]
    assert detok.text == " world! world"


# -- stop strings --------------------------------------------------------------------------------


def test_find_stop_string_only_in_new_characters():
    assert find_stop_string("Hello w", 2, ["lo w"], False) == ("lo w", 3)
    assert find_stop_string("Hello wo", 3, ["lo w"], True) == ("lo w", 7)  # text after it goes too
    assert find_stop_string("Hello world", 4, ["world"], False) == ("world", 6)
    # the match ended before the new characters: it was caught (or not) earlier
    assert find_stop_string("Hello world", 2, ["lo w"], False) is None
    assert find_stop_string("Hello world", 0, ["d"], False) is None
    assert find_stop_string("Hello", 5, ["x", "yz"], True) is None


def test_find_stop_string_first_completed_wins():
    # "bc" completes before "abcd" when characters arrive one by one
    assert find_stop_string("xabcd", 4, ["abcd", "bc"], False) == ("bc", 2)
    # same end: the one that starts first cuts more
    assert find_stop_string("xabcd", 4, ["cd", "abcd"], False) == ("abcd", 1)
    assert find_stop_string("xabcd", 4, ["cd", "abcd"], True) == ("abcd", 5)


def first_stop_when_streamed(text: str, cuts: list[int], stop: list[str], include: bool):
    seen = 0
    for cut in sorted({*cuts, len(text)}):
        if cut <= seen:
            continue
        found = find_stop_string(text[:cut], cut - seen, stop, include)
        if found:
            return found
        seen = cut
    return None


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc", max_size=30),
    cuts=st.lists(st.integers(0, 30), max_size=10),
    stop=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=3),
    include=st.booleans(),
)
def test_stop_found_is_independent_of_token_boundaries(text, cuts, stop, include):
    """However the text is cut into tokens, the first stop string found is the one that completes
    first in the text, found exactly once, at the same place."""
    per_char = first_stop_when_streamed(text, list(range(len(text) + 1)), stop, include)
    assert first_stop_when_streamed(text, cuts, stop, include) == per_char
    occurrences = [(text.find(s) + len(s), text.find(s), s) for s in stop if s in text]
    if not occurrences:
        assert per_char is None
    else:
        end, start, s = min(occurrences)
        assert per_char == (s, end if include else start)
