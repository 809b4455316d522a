"""store/replies.py: the reply shapes it declares are the ones a ``connect()`` client gets."""

from __future__ import annotations

import uuid

from batchinfer.redis_conn import connect
from batchinfer.store import replies


def _key(name: str) -> str:
    return f"test-replies-{uuid.uuid4().hex}:{name}"


def test_stream_replies_are_bytes_entries(redis_session) -> None:
    r = connect(redis_session.url)
    stream = _key("s")
    first = r.xadd(stream, replies.xadd_fields({"a": "1", "b": "two"}))
    r.xadd(stream, replies.xadd_fields({b"c": b"\xff"}))
    got = replies.entries(r.xrange(stream))
    assert got == [(first, {b"a": b"1", b"b": b"two"}), (got[1][0], {b"c": b"\xff"})]
    assert all(isinstance(entry_id, bytes) for entry_id, _ in got)
    read = replies.read_streams(r.xread({stream: "0-0"}, count=1))
    assert read == [(stream.encode(), [(first, {b"a": b"1", b"b": b"two"})])]
    assert isinstance(read[0], tuple)
    assert replies.read_streams(r.xread({stream: got[1][0]}, block=1)) == []  # timed out
    assert replies.entries(r.xrange(_key("missing"))) == []


def test_scored_members(redis_session) -> None:
    r = connect(redis_session.url)
    key = _key("z")
    r.zadd(key, {"low": 1, "high": 5})
    assert replies.scored(r.zrevrange(key, 0, -1, withscores=True)) == [(b"high", 5.0), (b"low", 1.0)]


def test_xadd_fields_copies() -> None:
    fields = {"v": "1"}
    out = replies.xadd_fields(fields)
    assert out == {"v": "1"} and out is not fields
