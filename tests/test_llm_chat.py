"""``LLM.chat`` (vLLM's): chat template, one or many conversations, errors; the progress bar rule."""

from __future__ import annotations

import io
import sys

import pytest

from batchinfer import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there!"}]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, num_kv_blocks=64)


def test_chat_renders_the_template_and_generates(llm, tiny_llama):
    (out,) = llm.chat(CHAT, GREEDY, use_tqdm=False)
    ids = llm.get_tokenizer().apply_chat_template(CHAT, tokenize=True)
    assert out.prompt_token_ids == ids
    (ref,) = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids and len(ref.outputs[0].token_ids) == 6
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(tiny_llama)
    rendered = hf.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    # transformers 5 returns a BatchEncoding, 4.x a list
    assert out.prompt_token_ids == list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)


def test_chat_of_many_conversations_keeps_their_order_and_logprobs(llm):
    chats = [CHAT, [{"role": "user", "content": "The quick brown fox"}], CHAT[1:]]
    outs = llm.chat(chats, SamplingParams(temperature=0.0, max_tokens=3, logprobs=1), use_tqdm=False)
    tok = llm.get_tokenizer()
    assert [o.prompt_token_ids for o in outs] == [tok.apply_chat_template(c, tokenize=True) for c in chats]
    for o in outs:
        c = o.outputs[0]
        assert len(c.logprobs) == 3 and c.cumulative_logprob is not None
        assert all(step[t].rank == 1 and step[t].decoded_token == tok.decode([t], skip_special_tokens=False)
                   for t, step in zip(c.token_ids, c.logprobs, strict=True))


def test_chat_options(llm):
    tok = llm.get_tokenizer()
    open_turn = [*CHAT, {"role": "assistant", "content": "Hi, I am"}]
    (out,) = llm.chat(open_turn, GREEDY, add_generation_prompt=False, continue_final_message=True,
                      use_tqdm=False)
    text = tok.decode(out.prompt_token_ids, skip_special_tokens=False)
    assert text.endswith("Hi, I am")  # the turn is left open: no end-of-turn token after it
    (plain,) = llm.chat(CHAT, GREEDY, chat_template="{% for m in messages %}{{ m['content'] }}|{% endfor %}",
                        use_tqdm=False)
    assert tok.decode(plain.prompt_token_ids) == "Be brief.|Hello there!|"


def test_chat_errors_name_the_conversation(llm):
    with pytest.raises(ValueError, match=r"messages\[1\]: .*unknown role"):
        llm.chat([CHAT, [{"role": "robot", "content": "x"}]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"messages: messages\[0\]\.role"):
        llm.chat([{"content": "no role"}], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="messages: expected"):
        llm.chat([], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat(CHAT, GREEDY, continue_final_message=True)
    assert not llm.engine.has_unfinished()


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_only_on_a_terminal_by_default(llm, monkeypatch):
    pipe = io.StringIO()  # what stderr is under a pipe or a file: not a terminal
    monkeypatch.setattr(sys, "stderr", pipe)
    llm.generate("Hello", GREEDY)
    assert pipe.getvalue() == ""
    llm.generate("Hello", GREEDY, use_tqdm=True)  # asked for: drawn anyway
    assert "generating" in pipe.getvalue()

    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    llm.chat(CHAT, GREEDY)
    assert "generating" in term.getvalue()
    before = term.getvalue()
    llm.generate("Hello", GREEDY, use_tqdm=False)
    assert term.getvalue() == before
