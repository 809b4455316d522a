"""Batch entries (batchinfer.protocol.batches): the wire bytes, both directions, malformed entries;
and the consumer-group helpers (batchinfer.redis_conn.ensure_group, read_group) against a real Redis."""

from __future__ import annotations

import json

import pytest

from batchinfer.protocol.batches import (
    BatchEntry,
    MalformedBatch,
    decode,
    encode,
    encode_raw,
    encode_request,
)
from batchinfer.protocol.rows import BatchRequest
from batchinfer.redis_conn import ensure_group


def _req(idx: int, **kw) -> BatchRequest:
    return BatchRequest(request_id=f"j:{idx}", job_id="j", idx=idx, prompt_token_ids=[5, 6],
                        sampling_params={"max_tokens": 2}, model="tiny", **kw)


def _as_read(fields: dict[str, str]) -> dict[bytes, bytes]:
    """The fields as a worker's XREADGROUP hands them back (bytes, decode_responses off)."""
    return {k.encode(): v.encode() for k, v in fields.items()}


def test_encode_writes_the_documented_wire_bytes():
    # docs/protocol.md, "Batch entry": v 1, requests = a JSON list of BatchRequest objects (compact,
    # fields in BatchRequest's order, UTF-8 kept as is), solo = 1 only on a solo batch
    q = _req(0, custom_id="é", metadata={"k": "v"})
    element = ('{"request_id":"j:0","job_id":"j","idx":0,"prompt_token_ids":[5,6],'
               '"sampling_params":{"max_tokens":2},"model":"tiny","line":null,"custom_id":"é",'
               '"reply_to":null,"metadata":{"k":"v"},"created_at":null,"attempts":0,"url":null}')
    assert encode_request(q) == element
    assert encode([q]) == {"v": "1", "requests": f"[{element}]"}
    assert encode([q], solo=True) == {"v": "1", "requests": f"[{element}]", "solo": "1"}
    assert encode_raw([element, element]) == {"v": "1", "requests": f"[{element},{element}]"}
    assert encode([]) == {"v": "1", "requests": "[]"}


def test_decode_round_trips_encode():
    requests = [_req(0, attempts=2, reply_to="r", line=7), _req(1, url="/v1/completions")]
    assert decode(_as_read(encode(requests))) == BatchEntry(requests=requests, rejected=[], solo=False)
    solo = decode(_as_read(encode(requests[:1], solo=True)))
    assert solo.solo and solo.requests == requests[:1]
    # a direct request (no job) needs no idx
    direct = BatchRequest(request_id="1-0", job_id=None, idx=None, prompt_token_ids=[1],
                          sampling_params={}, model="tiny")
    assert decode(_as_read(encode([direct]))).requests == [direct]


def test_decode_ignores_fields_a_newer_writer_added():
    fields = _as_read(encode([_req(0)]))
    items = json.loads(fields[b"requests"])
    items[0]["added_later"] = 1
    entry = decode({**fields, b"requests": json.dumps(items).encode(), b"extra": b"x"})
    assert entry.requests == [_req(0)] and not entry.rejected and not entry.solo


@pytest.mark.parametrize(("fields", "message"), [
    ({b"v": b"2", b"requests": b"[]"}, "unsupported batch protocol version b'2'"),
    ({b"requests": b"[]"}, "unsupported batch protocol version None"),
    ({b"v": b"1"}, "no 'requests' field"),
    ({b"v": b"1", b"requests": b"[{"}, "'requests' is not JSON"),
    ({b"v": b"1", b"requests": b"\xff"}, "'requests' is not JSON"),
    ({b"v": b"1", b"requests": b"{}"}, "'requests' is not a JSON list"),
])
def test_decode_refuses_an_entry_that_is_no_batch(fields, message):
    with pytest.raises(MalformedBatch, match=message) as caught:
        decode(fields)
    assert isinstance(caught.value, ValueError)  # what the worker daemon catches to dead-letter it


def test_decode_rejects_malformed_elements_and_keeps_the_rest():
    good = _req(0).to_dict()
    items = [good, {"job_id": "j", "idx": 4}, "not an object", {"idx": 1},
             {**good, "request_id": "j:-1", "idx": -1}, {**good, "request_id": ""}]
    entry = decode({b"v": b"1", b"requests": json.dumps(items).encode(), b"solo": b"1"})
    assert [q.request_id for q in entry.requests] == ["j:0"] and entry.solo
    assert [bad.item for bad in entry.rejected] == items[1:]
    assert [bad.route for bad in entry.rejected] == [("j", 4), None, None, None, ("j", 0)]
    assert entry.rejected[0].reason.startswith("request 1 of the batch is malformed: ")
    assert entry.rejected[3].reason == "request 4 of the batch has no valid request_id / idx"


def test_only_solo_1_marks_a_solo_batch():
    fields = _as_read(encode([_req(0)]))
    assert not decode({**fields, b"solo": b"0"}).solo
    assert decode({**fields, b"solo": b"1"}).solo


def test_ensure_group_creates_once_from_id_0_and_keeps_other_errors(redis_server):
    import redis

    r = redis_server.client()
    r.xadd("s", {"a": "1"})  # written before the group existed: the group must still deliver it
    assert ensure_group(r, "s", "g") is True
    assert ensure_group(r, "s", "g") is False  # BUSYGROUP: already there, not an error
    ((_, entries),) = r.xreadgroup("g", "c", {"s": ">"})
    assert [f for _, f in entries] == [{b"a": b"1"}]
    assert ensure_group(r, "fresh", "g") is True and r.exists("fresh")  # MKSTREAM
    r.set("k", "v")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        ensure_group(r, "k", "g")


def test_read_group_recreates_a_lost_group_and_reads_on_the_next_call(redis_server):
    import redis

    from batchinfer.redis_conn import read_group
    from batchinfer.store import replies

    r = redis_server.client()
    r.xadd("lost", {"a": "1"})  # no group yet: as after a Redis restart that kept only the stream
    assert read_group(r, "lost", "g", "c", ">", count=10, block_ms=None) == []
    got = replies.read_streams(read_group(r, "lost", "g", "c", ">", count=10, block_ms=None))
    assert [f for _, f in got[0][1]] == [{b"a": b"1"}]
    pending = replies.read_pending(read_group(r, "lost", "g", "c", "0", count=10, block_ms=None))
    assert [f for _, f in pending[0][1]] == [{b"a": b"1"}]  # still pending to c until acked
    r.set("k", "v")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        read_group(r, "k", "g", "c", ">", count=1, block_ms=None)
