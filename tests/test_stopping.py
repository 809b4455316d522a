"""check_stop: EOS, stop token ids, stop strings across tokens, min/max tokens, the final text."""

from __future__ import annotations

import pytest

from batchinfer.workers.models.tiny import EOS, EOT, build_tokenizer
from batchinfer.workers.sampling_params import SamplingParams
from batchinfer.workers.text.detokenizer import IncrementalDetokenizer
from batchinfer.workers.text.stopping import StopResult, check_stop


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def eos_ids(tok):
    return {tok.token_to_id(EOS), tok.token_to_id(EOT)}


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def generate(tok, eos_ids, ids: list[int], max_len: int | None = None, **params):
    """Feed tokens as the engine would (append, then check) until a stop; what came out."""
    p = SamplingParams(**{"max_tokens": None, **params})
    detok = IncrementalDetokenizer(tok, encode(tok, "Prompt:"), p.skip_special_tokens)
    out: list[int] = []
    for t in ids:
        out.append(t)
        full = max_len is not None and len(out) >= max_len
        result = check_stop(out, t, p, eos_ids, detok, max_len_reached=full)
        if result is not None:
            return result, out
    return None, out


def test_eos_stops_and_stays_out_of_the_text(tok, eos_ids):
    eos = tok.token_to_id(EOS)
    ids = encode(tok, "Hello world") + [eos] + encode(tok, " more")
    result, out = generate(tok, eos_ids, ids)
    assert result == StopResult("stop", None, "Hello world")
    assert out[-1] == eos  # the EOS token is the last of token_ids, as in vLLM
    # a second EOS id from generation_config stops too
    result, _ = generate(tok, eos_ids, encode(tok, "Hi") + [tok.token_to_id(EOT)])
    assert result == ("stop", None, "Hi")
    # include_stop_str_in_output keeps the token's own text (visible when specials are kept)
    result, _ = generate(tok, eos_ids, ids, include_stop_str_in_output=True, skip_special_tokens=False)
    assert result == ("stop", None, "Hello world<|end_of_text|>")


def test_ignore_eos_runs_to_max_tokens(tok, eos_ids):
    eos = tok.token_to_id(EOS)
    ids = encode(tok, "Hi") + [eos] + encode(tok, " there friend")
    result, out = generate(tok, eos_ids, ids, ignore_eos=True, max_tokens=len(ids) - 1)
    assert result.finish_reason == "length" and result.stop_reason is None
    assert result.text == tok.decode(out)
    assert len(out) == len(ids) - 1 and eos in out


def test_stop_token_ids(tok, eos_ids):
    ids = encode(tok, "Hello world! The")
    bang = ids.index(tok.token_to_id("!"))
    result, out = generate(tok, eos_ids, ids, stop_token_ids=[ids[bang]])
    assert result == ("stop", ids[bang], "Hello world")
    assert out == ids[: bang + 1]  # the stop token stays in token_ids
    result, _ = generate(tok, eos_ids, ids, stop_token_ids=[ids[bang]], include_stop_str_in_output=True)
    assert result == ("stop", ids[bang], "Hello world!")


def test_stop_string_across_token_boundaries(tok, eos_ids):
    ids = encode(tok, "Hello world! The quick")
    stop = "lo wor"
    assert not any(stop in tok.decode([t]) for t in ids)  # no single token holds it
    result, out = generate(tok, eos_ids, ids, stop=[stop, "never"])
    assert result == ("stop", stop, "Hel")
    assert tok.decode(out).endswith("wor")  # stopped at the token that completed it
    # with include_stop_str_in_output the text ends with the stop string; later text is cut
    result, _ = generate(tok, eos_ids, ids, stop=["lo wo"], include_stop_str_in_output=True)
    assert result == ("stop", "lo wo", "Hello wo")


def test_stop_string_inside_multibyte_text(tok, eos_ids):
    result, out = generate(tok, eos_ids, encode(tok, "héllo 世界 🙂 end"), stop=["界"])
    assert result == ("stop", "界", "héllo 世")
    assert tok.decode(out) == "héllo 世界"  # caught at the byte that completed the character


def test_stop_at_the_very_first_token(tok, eos_ids):
    ids = encode(tok, "Hello world")
    result, out = generate(tok, eos_ids, ids, stop=["He"])
    assert result == ("stop", "He", "") and len(out) == 1
    result, out = generate(tok, eos_ids, [tok.token_to_id(EOS)] + ids)
    assert result == ("stop", None, "") and len(out) == 1


def test_min_tokens_defers_every_kind_of_stop(tok, eos_ids):
    eos = tok.token_to_id(EOS)
    ids = encode(tok, "Hello world! The quick brown fox")
    n_hello = len(encode(tok, "Hello"))
    # the stop string completes within the first min_tokens tokens: not caught, then or later
    result, out = generate(tok, eos_ids, ids, stop=["Hello"], min_tokens=n_hello, max_tokens=len(ids))
    assert result.finish_reason == "length" and result.text == tok.decode(ids)
    # one token later it counts
    result, _ = generate(tok, eos_ids, ids, stop=["Hello"], min_tokens=n_hello - 1)
    assert result == ("stop", "Hello", "")
    # an EOS or stop token id inside min_tokens is an ordinary token (the sampler masks them anyway)
    result, out = generate(tok, eos_ids, [eos, *ids], min_tokens=1, max_tokens=3)
    assert result.finish_reason == "length" and len(out) == 3
    result, out = generate(tok, eos_ids, [ids[0], eos, *ids], min_tokens=1)
    assert result == ("stop", None, tok.decode(ids[:1])) and len(out) == 2
    result, out = generate(tok, eos_ids, ids, stop_token_ids=[ids[0]], min_tokens=2, max_tokens=2)
    assert result.finish_reason == "length"


def test_length_limits(tok, eos_ids):
    ids = encode(tok, "Hello world! The quick brown fox")
    result, out = generate(tok, eos_ids, ids, max_tokens=4)
    assert result == ("length", None, tok.decode(ids[:4])) and len(out) == 4
    result, out = generate(tok, eos_ids, ids, max_len=3)  # max_model_len reached
    assert result.finish_reason == "length" and len(out) == 3
    result, _ = generate(tok, eos_ids, ids)  # max_tokens=None and room left: runs out of input
    assert result is None


def test_stop_wins_over_length_on_the_same_token(tok, eos_ids):
    ids = encode(tok, "Hello world")
    result, _ = generate(tok, eos_ids, ids, stop=["wor"], max_tokens=len(encode(tok, "Hello wor")))
    assert result == ("stop", "wor", "Hello ")
    result, _ = generate(tok, eos_ids, ids[:1] + [tok.token_to_id(EOS)], max_tokens=2)
    assert result == ("stop", None, tok.decode(ids[:1]))


def test_length_flushes_an_incomplete_character(tok, eos_ids):
    ids = encode(tok, "ok 世")
    result, _ = generate(tok, eos_ids, ids, max_tokens=len(ids) - 1)
    assert result == ("length", None, "ok \ufffd")  # what decode() of those tokens gives
    result, _ = generate(tok, eos_ids, ids[:-1] + [tok.token_to_id(EOS)])
    assert result == ("stop", None, "ok \ufffd")


def test_without_detokenizer(tok, eos_ids):
    p = SamplingParams(stop=["x"], stop_token_ids=[5], max_tokens=3)
    assert check_stop([1], 1, p, eos_ids, None) is None
    assert check_stop([1, 5], 5, p, eos_ids, None) == ("stop", 5, "")
    assert check_stop([1, 2, 3], 3, p, eos_ids, None) == ("length", None, "")


def test_output_must_end_with_the_new_token(tok, eos_ids):
    with pytest.raises(ValueError, match="output_token_ids must end with new_token_id"):
        check_stop([1, 2], 3, SamplingParams(), eos_ids, None)
    with pytest.raises(ValueError, match="output_token_ids must end with new_token_id"):
        check_stop([], 3, SamplingParams(), eos_ids, None)
