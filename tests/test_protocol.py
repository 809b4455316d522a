"""The wire protocol: intake entries, job ids, batch requests and rows (request bodies: test_bodies.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from batchinfer.protocol.bodies import parse_body
from batchinfer.protocol.entries import PROTOCOL_VERSION, IntakeEntry, RequestError, valid_job_id
from batchinfer.protocol.rows import BatchRequest, ResultRow
from batchinfer.workers.engine.outputs import CompletionOutput, Logprob, RequestOutput
from batchinfer.workers.sampling_params import SamplingParams
from batchinfer.workers.service.rows import generation_row

# -- intake entries --------------------------------------------------------------------------------


def test_intake_entry_round_trip():
    entry = IntakeEntry(body='{"prompt":"x"}', job_id="job-1", idx=4, line=5, reply_to="{bi}:reply:1",
                        client_request_id="abc")
    fields = entry.to_fields()
    assert fields["v"] == PROTOCOL_VERSION and fields["idx"] == "4"
    raw = {k.encode(): v.encode() for k, v in fields.items()}
    assert IntakeEntry.from_fields(raw) == entry
    direct = IntakeEntry(body="{}")
    assert direct.to_fields() == {"v": "1", "body": "{}"}
    assert IntakeEntry.from_fields(direct.to_fields()) == direct


BAD_ENTRIES = [
    ({b"body": b"{}"}, "v", "no protocol version"),
    ({b"v": b"2", b"body": b"{}"}, "v", "unsupported protocol version v='2'"),
    ({b"v": b"1"}, "body", "no 'body' field"),
    ({b"v": b"1", b"body": b"{}", b"colour": b"red"}, "colour", "unknown intake field(s): colour"),
    ({b"v": b"1", b"body": b"{}", b"job": b"j1"}, "idx", "needs 'idx'"),
    ({b"v": b"1", b"body": b"{}", b"job": b"j1", b"idx": b"-1"}, "idx", "idx must be a non-negative"),
    ({b"v": b"1", b"body": b"{}", b"job": b"j1", b"idx": b"x"}, "idx", "idx must be a non-negative"),
    ({b"v": b"1", b"body": b"{}", b"job": b"a b", b"idx": b"0"}, "job", "job id 'a b' is invalid"),
    ({b"v": b"1", b"body": b"{}", b"job": b"j1", b"idx": b"0", b"line": b"0"}, "line",
     "line must be a positive"),
]


@pytest.mark.parametrize("raw,field,words", BAD_ENTRIES)
def test_bad_intake_entries(raw, field, words):
    with pytest.raises(RequestError) as info:
        IntakeEntry.from_fields(raw)
    err = info.value
    assert err.code == "protocol_error" and err.field == field
    assert words in str(err)


def test_bad_entry_keeps_context_for_its_error_row():
    with pytest.raises(RequestError) as info:
        IntakeEntry.from_fields({b"v": b"9", b"body": b"{}", b"job": b"j1", b"idx": b"7", b"line": b"8",
                                 b"reply_to": b"r"})
    err = info.value
    assert err.context == {"job": "j1", "idx": 7, "line": 8, "reply_to": "r"}
    assert err.line == 8 and str(err).startswith("line 8: ")


def test_non_utf8_entry():
    with pytest.raises(RequestError, match="not UTF-8") as info:
        IntakeEntry.from_fields({b"v": b"1", b"body": b"\xff"})
    assert info.value.code == "protocol_error"


def test_job_ids():
    assert valid_job_id("job_01a2_ff") and valid_job_id("a.b-c") and valid_job_id("x" * 128)
    for bad in ("", "-x", "a b", "a:b", "é", "x" * 129, "a/b", "job\n", "\njob", "jöb", "٣job", "job٣"):
        assert not valid_job_id(bad), bad


# -- batch requests and rows -----------------------------------------------------------------------


def batch_request() -> BatchRequest:
    return BatchRequest(request_id="j:3", job_id="j", idx=3, prompt_token_ids=[1, 2, 3],
                        sampling_params=SamplingParams(max_tokens=2).to_dict(), model="m", line=4,
                        custom_id="c", reply_to=None, metadata={"k": "v"}, created_at=1000,
                        url="/v1/chat/completions")


def test_batch_request_round_trip():
    req = batch_request()
    assert BatchRequest.from_dict(json.loads(json.dumps(req.to_dict()))) == req
    assert req.params().max_tokens == 2
    assert BatchRequest.from_dict({**req.to_dict(), "added_by_a_newer_writer": 1}) == req


def test_result_row_for_request():
    out = RequestOutput(request_id="j:3", prompt_token_ids=[1, 2, 3], num_cached_tokens=2, outputs=[
        CompletionOutput(index=0, text="ab", token_ids=[7, 8], finish_reason="length",
                         logprobs=[{7: Logprob(-0.1, 1, "a", b"a")},
                                   {8: Logprob(-2.5, 3, "\ufffd", b"\xe2"), 5: Logprob(-0.2, 1, "x"),
                                    6: Logprob(-0.3, 2, "y")}],
                         cumulative_logprob=-2.6),
        CompletionOutput(index=1, text="c", token_ids=[9], finish_reason="stop")], finished=True)
    row = generation_row(batch_request(), out, worker="w1", started_at=1500, finished_at=2000)
    assert (row.status, row.output_text, row.output_token_ids, row.finish_reason) == ("completed", "ab",
                                                                                      [7, 8], "length")
    assert (row.prompt_tokens, row.completion_tokens, row.cached_tokens) == (3, 3, 2)
    assert (row.line, row.custom_id, row.worker, row.url) == (4, "c", "w1", "/v1/chat/completions")
    # batch_request() asks for no logprobs: top_logprobs then hold every entry of rank 1..len(step)
    first, second = row.outputs[0]["logprobs"]
    assert first == {"token_id": 7, "token": "a", "bytes": [97], "logprob": -0.1,
                     "top_logprobs": [{"token_id": 7, "token": "a", "bytes": [97], "logprob": -0.1}]}
    assert (second["token_id"], second["token"], second["bytes"]) == (8, "\ufffd", [0xE2])  # raw bytes
    assert [t["token_id"] for t in second["top_logprobs"]] == [5, 6, 8]  # best first, by rank
    assert row.outputs[0]["cumulative_logprob"] == -2.6
    assert row.outputs[1]["logprobs"] is None and row.outputs[1]["cumulative_logprob"] is None
    asked = SamplingParams(max_tokens=2, logprobs=2).to_dict()
    two = generation_row(dataclasses.replace(batch_request(), sampling_params=asked), out)
    # the sampled token 8 has rank 3: not among the top 2
    assert [t["token_id"] for t in two.outputs[0]["logprobs"][1]["top_logprobs"]] == [5, 6]
    again = ResultRow.from_json(row.to_json())
    assert again == row
    assert (row.accepted_prediction_tokens, row.rejected_prediction_tokens) == (None, None)  # no prediction


def test_result_row_sums_the_completions_prediction_counts():
    out = RequestOutput(request_id="j:3", prompt_token_ids=[1, 2, 3], finished=True, outputs=[
        CompletionOutput(index=0, text="ab", token_ids=[7, 8], finish_reason="length",
                         accepted_prediction_tokens=2, rejected_prediction_tokens=1),
        CompletionOutput(index=1, text="c", token_ids=[9], finish_reason="stop",
                         accepted_prediction_tokens=0, rejected_prediction_tokens=3)])
    row = generation_row(batch_request(), out)
    assert (row.accepted_prediction_tokens, row.rejected_prediction_tokens) == (2, 4)
    assert ResultRow.from_json(row.to_json()) == row


def test_result_row_error():
    row = ResultRow.error("prompt_too_long", "line 4: too long", request=batch_request())
    assert (row.status, row.error_code, row.job_id, row.idx, row.line) == (
        "failed", "prompt_too_long", "j", 3, 4)
    assert row.finished_at is not None and row.output_text is None
    bare = ResultRow.error("invalid_json", "bad", job_id="j", idx=9, line=10, status="failed")
    assert bare.request_id == "j:9"
    cancelled = ResultRow.error("cancelled", "job cancelled", status="cancelled", request=batch_request())
    assert cancelled.status == "cancelled" and not cancelled.ok
    with pytest.raises(ValueError, match="status must be one of"):
        ResultRow.error("x", "y", job_id="j", idx=1, status="done")
    with pytest.raises(ValueError, match="direct request needs"):
        ResultRow.error("x", "y")


def test_result_row_with_a_lone_surrogate_is_still_sendable():
    row = ResultRow.error("invalid_request", "bad", job_id="j", idx=0, custom_id="a\ud800b")
    text = row.to_json()
    text.encode("utf-8")  # would raise without the ASCII fallback
    assert ResultRow.from_json(text).custom_id == "a\ud800b"
    assert ResultRow.error("x", "é", job_id="j", idx=1).to_json().count("é") == 1  # UTF-8 kept otherwise


def test_a_row_s_json_is_its_fields_in_order_and_what_orjson_refuses_still_encodes():
    """ResultRow.to_json lets orjson read the dataclass itself: the same text as the compact JSON of
    its fields in order; a lone surrogate is escaped and an int past 64 bits kept exact."""
    import json as std_json

    from batchinfer.protocol import compact_json
    from batchinfer.protocol.rows import ResultRow, fields_dict

    row = ResultRow(job_id="j", request_id="j:1", status="completed", idx=1, output_token_ids=[5, 6],
                    output_text="héllo \u2028", metadata={"k": "v"}, sampling_params={"temperature": 0.5})
    assert row.to_json() == compact_json.dumps(fields_dict(row))
    assert list(std_json.loads(row.to_json())) == list(fields_dict(row))
    odd = ResultRow(job_id="j", request_id="j:2", status="failed", error_message="bad \ud800",
                    prompt_tokens=2**70)
    back = std_json.loads(odd.to_json())
    assert back["error_message"] == "bad \ud800" and back["prompt_tokens"] == 2**70
    expected = std_json.dumps(fields_dict(odd), separators=(",", ":"), ensure_ascii=False)
    assert compact_json.dumps(odd, default=fields_dict) == expected


@pytest.mark.parametrize("depth", [995, 1020])
def test_a_body_nested_deeper_than_json_reads_is_refused_as_such(depth):
    """orjson reads nesting up to 1,024 levels, json fails near the recursion limit: a body that
    deep gets the error json's path gives, not one from whichever check meets the nesting later."""
    body = '{"prompt_token_ids": [1], "metadata": ' + "[" * depth + "]" * depth + "}"
    with pytest.raises(RequestError, match="nested too deeply") as caught:
        parse_body(body, line=7)
    assert caught.value.code == "invalid_json" and caught.value.line == 7


def test_a_body_with_many_brackets_reads_the_same_either_way():
    messages = [{"role": "user", "content": [{"type": "text", "text": f"part {i}"}]} for i in range(300)]
    body = json.dumps({"messages": messages, "max_tokens": 4})  # 600+ brackets: json's path whole
    assert parse_body(body) == parse_body(json.loads(body))
