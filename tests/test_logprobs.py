"""Logprobs from the engine to every output: token text and bytes, rows, OpenAI shapes, Parquet;
and the OpenAI format's error lines. Ends with a job through real daemons (tiny Llama worker)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models

from batchinfer.jobs.formats import LOGPROB_TYPE, RESULT_SCHEMA, arrow_table, openai_line
from batchinfer.jobs.output import write_rows
from batchinfer.protocol.bodies import parse_body
from batchinfer.protocol.entries import RequestError
from batchinfer.protocol.rows import BatchRequest, ResultRow
from batchinfer.workers.engine.outputs import CompletionOutput, Logprob, RequestOutput
from batchinfer.workers.models.tiny import build_tokenizer
from batchinfer.workers.sampling_params import SamplingParams
from batchinfer.workers.service.rows import generation_row
from batchinfer.workers.text.tokenizer import Tokenizer

CHAT_URL, CMPL_URL = "/v1/chat/completions", "/v1/completions"


# -- decoded tokens and their bytes ----------------------------------------------------------------


def test_byte_level_tokens_give_their_raw_bytes():
    tok = Tokenizer(build_tokenizer())
    text = "Hello €uro"  # "€" is 3 bytes: the tiny BPE has no merge for them, so 3 one-byte tokens
    ids = tok.encode(text, add_special_tokens=False)
    pieces = [tok.decode_token(t) for t in ids]
    assert b"".join(raw for _, raw in pieces) == text.encode("utf-8")
    partial = [(t, raw) for t, raw in pieces if t == "\ufffd"]
    assert [raw for _, raw in partial] == [b"\xe2", b"\x82", b"\xac"]  # raw bytes, as OpenAI gives them
    for t, raw in pieces:
        if t != "\ufffd":
            assert raw == t.encode("utf-8")
    bos = tok.backend.token_to_id("<|begin_of_text|>")
    assert tok.decode_token(bos) == ("<|begin_of_text|>", b"<|begin_of_text|>")  # special tokens kept


def test_byte_fallback_and_sentencepiece_tokens():
    vocab = {"<unk>": 0, "<0xE2>": 1, "<0x82>": 2, "<0xAC>": 3, "\u2581a": 4, "b": 5}
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok = Tokenizer(backend)
    assert tok.decode_token(1) == ("\ufffd", b"\xe2")
    assert tok.decode_token(4) == ("a", b"a")  # decoded alone, as vLLM's decoded_token
    assert tok.decode_token(5) == ("b", b"b")


# -- rows and their renderings ----------------------------------------------------------------------


def _request(url: str | None, logprobs: int | None) -> BatchRequest:
    return BatchRequest(request_id="j:0", job_id="j", idx=0, prompt_token_ids=[1, 2], model="m", line=1,
                        sampling_params=SamplingParams(max_tokens=2, logprobs=logprobs).to_dict(),
                        custom_id="c0", url=url)


def _output(with_logprobs: bool = True) -> RequestOutput:
    steps = [
        {10: Logprob(-0.5, 1, " Hi", b" Hi"), 11: Logprob(-1.25, 2, "!", b"!")},
        # the sampled token (part of a character) ranks 3rd: outside a top 2
        {12: Logprob(-2.0, 3, "\ufffd", b"\xe2"), 10: Logprob(-0.25, 1, " Hi", b" Hi"),
         13: Logprob(-1.5, 2, " there", b" there")},
    ]
    completion = CompletionOutput(index=0, text=" Hi\ufffd", token_ids=[10, 12], finish_reason="length",
                                  logprobs=steps if with_logprobs else None,
                                  cumulative_logprob=-2.5 if with_logprobs else None)
    return RequestOutput("j:0", [1, 2], [completion], finished=True)


def _row(url: str | None, logprobs: int | None = 2, with_logprobs: bool = True) -> dict:
    return generation_row(_request(url, logprobs), _output(with_logprobs), finished_at=5000).to_dict()


def test_row_logprobs_carry_token_text_bytes_and_the_top_k():
    out = _row(CHAT_URL)["outputs"][0]
    first, second = out["logprobs"]
    hi = {"token_id": 10, "token": " Hi", "bytes": [32, 72, 105], "logprob": -0.5}
    bang = {"token_id": 11, "token": "!", "bytes": [33], "logprob": -1.25}
    assert first == {**hi, "top_logprobs": [hi, bang]}
    assert second["token_id"] == 12 and second["bytes"] == [0xE2]
    assert [t["token_id"] for t in second["top_logprobs"]] == [10, 13]
    assert out["cumulative_logprob"] == -2.5
    assert ResultRow.from_json(json.dumps(_row(CHAT_URL))).outputs[0]["logprobs"] == out["logprobs"]
    # logprobs=0: the sampled token alone, no top list
    assert _row(CHAT_URL, logprobs=0)["outputs"][0]["logprobs"][0]["top_logprobs"] == []


def test_openai_chat_logprobs_shape():
    line = json.loads(openai_line(_row(CHAT_URL)))
    lp = line["response"]["body"]["choices"][0]["logprobs"]
    assert lp["refusal"] is None
    assert lp["content"][0] == {"token": " Hi", "logprob": -0.5, "bytes": [32, 72, 105],
                                "top_logprobs": [{"token": " Hi", "logprob": -0.5, "bytes": [32, 72, 105]},
                                                 {"token": "!", "logprob": -1.25, "bytes": [33]}]}
    assert lp["content"][1]["bytes"] == [0xE2] and len(lp["content"][1]["top_logprobs"]) == 2
    none = json.loads(openai_line(_row(CHAT_URL, logprobs=None, with_logprobs=False)))
    assert none["response"]["body"]["choices"][0]["logprobs"] is None


def test_openai_completions_logprobs_shape():
    line = json.loads(openai_line(_row(CMPL_URL)))
    lp = line["response"]["body"]["choices"][0]["logprobs"]
    assert lp["tokens"] == [" Hi", "\ufffd"]
    assert lp["token_logprobs"] == [-0.5, -2.0]
    # OpenAI: the top `logprobs` tokens plus the sampled one
    assert lp["top_logprobs"] == [{" Hi": -0.5, "!": -1.25}, {" Hi": -0.25, " there": -1.5, "\ufffd": -2.0}]
    assert lp["text_offset"] == [0, 3]
    # rows of the earlier form ({"<token id>": logprob}) hold no token text: null, not a crash
    old = _row(CMPL_URL)
    old["outputs"][0]["logprobs"] = [{"10": -0.5}, {"12": -2.0}]
    assert json.loads(openai_line(old))["response"]["body"]["choices"][0]["logprobs"] is None
    assert arrow_table([old]).column("outputs").to_pylist()[0][0]["logprobs"] is None


def test_parquet_logprobs_column_is_typed(tmp_path):
    path = write_rows([_row(CHAT_URL), _row(CMPL_URL, logprobs=None, with_logprobs=False)],
                      str(tmp_path / "r.parquet"))
    table = pq.read_table(path)
    assert table.schema.equals(RESULT_SCHEMA)
    output_type = table.schema.field("outputs").type.value_type
    assert output_type.field("logprobs").type == pa.list_(LOGPROB_TYPE)
    assert output_type.field("cumulative_logprob").type == pa.float64()
    assert LOGPROB_TYPE.field("bytes").type == pa.binary()
    assert LOGPROB_TYPE.field("logprob").type == pa.float32()
    first, second = (row["outputs"][0] for row in table.to_pylist())
    step = first["logprobs"][1]
    assert (step["token_id"], step["token"], step["bytes"], step["logprob"]) == (12, "\ufffd", b"\xe2", -2.0)
    assert [t["token_id"] for t in step["top_logprobs"]] == [10, 13]
    assert first["cumulative_logprob"] == -2.5
    assert second["logprobs"] is None and second["cumulative_logprob"] is None


# -- error lines in the OpenAI format ---------------------------------------------------------------


def _error_row(body: str, line: int) -> dict:
    """The error row the scheduler writes for ``body`` on input line ``line``."""
    with pytest.raises(RequestError) as err:
        parse_body(body, line=line)
    e = err.value
    message = f"{e.field}: {e.message}" if e.field and e.field not in e.message else e.message
    return ResultRow.error(e.code, message, job_id="j", idx=line - 1, line=line).to_dict()


def test_openai_error_lines_name_the_file_line_and_the_column():
    row = _error_row('{"prompt": "hi", "max_tokens": 3 "temperature": 0}', line=7)
    # json's own position ("line 1 column 34 (char 33)") counts the body's text, not the file's lines
    error = json.loads(openai_line(row))["error"]
    assert error == {"code": "invalid_json", "line": 7,
                     "message": "line 7: invalid JSON: Expecting ',' delimiter (column 34)"}
    multi = _error_row('{"prompt": "hi",\n "max_tokens": 3 "x": 1}', line=2)
    assert json.loads(openai_line(multi))["error"]["message"].endswith("(line 2 of the body, column 18)")
    field = json.loads(openai_line(_error_row('{"prompt": "hi", "temperature": -1}', line=3)))["error"]
    assert field["message"].startswith("line 3: temperature") and field["line"] == 3
    cancelled = ResultRow.error("cancelled", "the job was cancelled", status="cancelled", job_id="j", idx=0,
                                line=1).to_dict()
    assert json.loads(openai_line(cancelled))["error"]["message"] == "the job was cancelled"


# -- end to end: a job through the daemons ----------------------------------------------------------


@pytest.mark.slow
def test_logprobs_through_a_worker_in_jsonl_openai_and_parquet(redis_session, tiny_llama, tmp_path):
    from daemons import Stack

    from batchinfer.workers.entrypoints.llm import LLM

    model = tiny_llama.name
    chat = [{"role": "user", "content": "Hello there!"}]
    lines = [
        {"custom_id": "chat", "method": "POST", "url": CHAT_URL,
         "body": {"model": model, "messages": chat, "max_completion_tokens": 5, "temperature": 0,
                  "logprobs": True, "top_logprobs": 2}},
        {"custom_id": "cmpl", "method": "POST", "url": CMPL_URL,
         "body": {"model": model, "prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0,
                  "logprobs": 2}},
        {"custom_id": "none", "method": "POST", "url": CMPL_URL,
         "body": {"model": model, "prompt": "Hello", "max_tokens": 3, "temperature": 0}},
        '{"custom_id": "bad", "body": {"prompt": "x" "max_tokens": 2}}',
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")

    stack = Stack(redis_session.url, tmp_path, env={"BATCHINFER_OUTPUT_URI_PREFIXES": tmp_path.as_uri()})
    try:
        stack.start("scheduler", "scheduler")
        stack.worker("worker", tiny_llama)
        stack.start("exporter", "exporter")
        stack.wait_for_workers(1)
        out = tmp_path / "out.parquet"
        sub = stack.cli("submit", str(src), "--model", model, "--output", out.as_uri(), "--json")
        assert sub.returncode == 0, f"{sub.stdout}\n{sub.stderr}\n{stack.logs()}"
        job = json.loads(sub.stdout)["job_id"]
        waited = stack.cli("wait", job, "--json")
        assert waited.returncode == 0, f"{waited.stdout}\n{waited.stderr}\n{stack.logs()}"
        rendered = {}
        for fmt in ("jsonl", "openai"):
            path = tmp_path / f"r.{fmt}.jsonl"
            res = stack.cli("results", job, "-o", str(path), "--format", fmt)
            assert res.returncode == 0, res.stderr
            rendered[fmt] = {x["custom_id"]: x for x in map(json.loads, path.read_text().splitlines())}
    finally:
        stack.close()

    # The in-process engine with the same parameters is the reference.
    llm = LLM(tiny_llama)
    tok = llm.get_tokenizer()
    chat_ids = tok.apply_chat_template(chat, tokenize=True)
    ref_chat, ref_cmpl = llm.generate(
        [{"prompt_token_ids": chat_ids}, "The quick brown fox"],
        [SamplingParams(max_tokens=5, temperature=0, logprobs=2),
         SamplingParams(max_tokens=4, temperature=0, logprobs=2)], use_tqdm=False)

    def expect(ref: RequestOutput) -> list[tuple[int, str, float, list[int]]]:
        c = ref.outputs[0]
        return [(t, step[t].decoded_token or "", step[t].logprob,
                 [i for i, _ in sorted(((i, v) for i, v in step.items() if (v.rank or 0) <= 2),
                                       key=lambda x: x[1].rank or 0)])
                for t, step in zip(c.token_ids, c.logprobs or [], strict=True)]

    jsonl = rendered["jsonl"]
    for cid, ref in (("chat", ref_chat), ("cmpl", ref_cmpl)):
        got = jsonl[cid]["outputs"][0]["logprobs"]
        want = expect(ref)
        assert [(g["token_id"], g["token"]) for g in got] == [(t, s) for t, s, _, _ in want], cid
        assert all(math.isclose(g["logprob"], w[2], abs_tol=1e-4) for g, w in zip(got, want, strict=True))
        assert [[t["token_id"] for t in g["top_logprobs"]] for g in got] == [top for *_, top in want]
        assert all(bytes(g["bytes"]) == tok.decode_token(g["token_id"])[1] for g in got)
        cumulative = ref.outputs[0].cumulative_logprob
        assert jsonl[cid]["outputs"][0]["cumulative_logprob"] == pytest.approx(cumulative, abs=1e-3)
    assert jsonl["none"]["outputs"][0]["logprobs"] is None

    openai = rendered["openai"]
    chat_lp = openai["chat"]["response"]["body"]["choices"][0]["logprobs"]
    assert [c["token"] for c in chat_lp["content"]] == [s for _, s, _, _ in expect(ref_chat)]
    assert all(len(c["top_logprobs"]) == 2 and isinstance(c["bytes"], list) for c in chat_lp["content"])
    cmpl_lp = openai["cmpl"]["response"]["body"]["choices"][0]["logprobs"]
    assert cmpl_lp["tokens"] == [s for _, s, _, _ in expect(ref_cmpl)]
    assert len(cmpl_lp["token_logprobs"]) == len(cmpl_lp["top_logprobs"]) == len(cmpl_lp["text_offset"]) == 4
    assert openai["none"]["response"]["body"]["choices"][0]["logprobs"] is None
    bad = next(x for x in openai.values() if x["error"])
    assert bad["error"]["code"] == "invalid_json"
    assert bad["error"]["message"].startswith("line 4: invalid JSON")
    assert "line 1 column" not in bad["error"]["message"]

    table = pq.read_table(out)
    by_id = {r["custom_id"]: r for r in table.to_pylist()}
    chat_steps = by_id["chat"]["outputs"][0]["logprobs"]
    assert [s["token_id"] for s in chat_steps] == [t for t, *_ in expect(ref_chat)]
    assert all(isinstance(s["bytes"], bytes) and len(s["top_logprobs"]) == 2 for s in chat_steps)
    assert by_id["none"]["outputs"][0]["logprobs"] is None
    assert Path(out).exists()
