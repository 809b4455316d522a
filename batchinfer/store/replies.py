"""Typed views of redis-py's replies and arguments, for connections made by ``connect``.

redis-py declares each reply as the union of every form it can take (RESP2 or RESP3, bytes or
decoded text, trimmed entries as ``None``), and ``xadd``'s field map as an invariant ``dict`` of
its own key and value unions, which no ``dict[str, str]`` matches. Our connections are all made
by :func:`batchinfer.redis_conn.connect` with RESP2 and ``decode_responses=False``, so a reply
has exactly one form: these functions say which, in one place, instead of each caller narrowing
redis-py's unions again. Nothing is converted but the outer lists of an XREAD reply.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from redis.typing import EncodableT, FieldT

Fields = dict[bytes, bytes]
"""A stream entry's field map as read back."""
Entry = tuple[bytes, Fields]
"""``(entry id, fields)`` of an XRANGE / XREVRANGE / XREAD / XREADGROUP ``>`` reply."""


def entries(reply: object) -> list[Entry]:
    """An XRANGE or XREVRANGE reply (``[]`` where redis-py's annotation allows ``None``).

    Not for replies that can hold trimmed entries (XCLAIM, XAUTOCLAIM, XREADGROUP from an id):
    redis-py gives those as ``(id, None)``.
    """
    return cast("list[Entry]", reply or [])


def read_streams(reply: object) -> list[tuple[bytes, list[Entry]]]:
    """An XREAD or XREADGROUP ``>`` reply: ``(stream name, entries)`` per stream; ``[]`` on a timeout.

    RESP2 gives each stream as a 2-item list; it is unpacked into a tuple here.
    """
    return [(name, got) for name, got in cast("list[list[Any]]", reply or [])]


def read_pending(reply: object) -> list[tuple[bytes, list[tuple[bytes, Fields | None]]]]:
    """An XREADGROUP reply read from an id rather than ``>`` (the consumer's own pending entries).

    As :func:`read_streams`, but an entry deleted from the stream while it was pending comes back
    without its fields: ``None``, or ``{}`` from the redis-py versions that parse it so.
    """
    return [(name, got) for name, got in cast("list[list[Any]]", reply or [])]


def xadd_fields(fields: Mapping[str, str] | Mapping[bytes, bytes]) -> dict[FieldT, EncodableT]:
    """``fields`` typed as ``xadd`` declares its field map. A cast, not a copy: it sits on the
    row-publishing path, and redis-py only iterates ``items()``."""
    return cast("dict[FieldT, EncodableT]", fields)


def scored(reply: object) -> list[tuple[bytes, float]]:
    """A ZRANGE / ZREVRANGE ``withscores=True`` reply: ``(member, score)`` pairs."""
    return cast("list[tuple[bytes, float]]", reply)


def members(reply: object) -> list[bytes]:
    """A ZRANGE / ZREVRANGE reply without scores: the members, in order."""
    return cast("list[bytes]", reply)


def hash_fields(reply: object) -> Fields:
    """An HGETALL reply: field -> value (``{}`` for a missing key)."""
    return cast("Fields", reply)


def delivery_counts(reply: object) -> dict[bytes, int]:
    """An XPENDING (extended form) reply: entry id -> times it was delivered."""
    return {p["message_id"]: int(p["times_delivered"]) for p in cast("list[dict[str, Any]]", reply or [])}
