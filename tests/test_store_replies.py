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


def test_read_pending_gives_entries_deleted_while_pending_without_fields(redis_session) -> None:
    r = connect(redis_session.url)
    stream = _key("p")
    kept, gone = r.xadd(stream, {"a": "1"}), r.xadd(stream, {"b": "2"})
    r.xgroup_create(stream, "g", id="0")
    r.xreadgroup("g", "c", {stream: ">"})  # both pending to consumer c now
    r.xdel(stream, gone)
    read = replies.read_pending(r.xreadgroup("g", "c", {stream: "0-0"}))
    assert [name for name, _ in read] == [stream.encode()]
    (kept_id, kept_fields), (gone_id, gone_fields) = read[0][1]
    assert (kept_id, kept_fields) == (kept, {b"a": b"1"})
    assert gone_id == gone and not gone_fields  # None or {}, by redis-py version
    assert replies.read_pending(r.xreadgroup("g", "c", {stream: gone})) == [(stream.encode(), [])]


def test_members_and_hash_fields_are_bytes(redis_session) -> None:
    r = connect(redis_session.url)
    z, h = _key("zm"), _key("h")
    r.zadd(z, {"b": 2, "a": 1})
    assert replies.members(r.zrange(z, 0, -1)) == [b"a", b"b"]
    assert replies.members(r.zrevrange(z, 0, -1)) == [b"b", b"a"]
    assert replies.members(r.zrange(_key("missing"), 0, -1)) == []
    r.hset(h, mapping={"f": "1", "g": b"\xff"})
    assert replies.hash_fields(r.hgetall(h)) == {b"f": b"1", b"g": b"\xff"}
    assert replies.hash_fields(r.hgetall(_key("missing"))) == {}
