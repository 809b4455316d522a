"""What ``Client.submit`` writes to the intake stream, entry by entry: exactly what docs/protocol.md
("Jobs") tells a producer to XADD (``op open``, ``v 1 body <JSON> job <job> idx <n> line <n>`` per
request, ``op close``), whether a chunk is cut by its count or by its bodies' size.

The client adds a chunk's request entries with one ``add_requests`` Lua script call; these tests
compare the stream, field by field and in order, with the protocol's text and with what plain
XADDs of the same entries write, and count the script calls to see where chunks were cut.
"""

from __future__ import annotations

import json

import pytest
import redis

from batchinfer.client.client import SUBMIT_CHUNK, Client
from batchinfer.config import Settings
from batchinfer.protocol.entries import PROTOCOL_VERSION
from batchinfer.store import scripts

Fields = list[tuple[bytes, bytes]]


@pytest.fixture
def client(redis_server):
    c = Client(settings=Settings(redis_url=redis_server.url, prefix="{e}"))
    yield c
    c.close()


def stream(client: Client) -> list[Fields]:
    """Every intake entry's fields, in stream order and in field order."""
    return [list(fields.items()) for _, fields in client.redis.xrange(client.keys.requests)]


def add_requests_calls(client: Client) -> int:
    """``add_requests`` calls since the slow log was reset (it logs every command)."""
    sha = scripts.register(client.redis, "add_requests").sha.encode()
    return sum(1 for e in client.redis.slowlog_get(10_000)
               if e["command"].split()[:2] in ([b"EVALSHA", sha], [b"evalsha", sha]))


def protocol_entry(job: str, idx: int, line: int, body: str) -> Fields:
    """A request entry as docs/protocol.md spells it, with the `line` the client adds."""
    return [(b"v", PROTOCOL_VERSION.encode()), (b"body", body.encode()), (b"job", job.encode()),
            (b"idx", str(idx).encode()), (b"line", str(line).encode())]


def submit(client: Client, bodies: list[str], **kwargs) -> tuple[str, list[int], int]:
    """(job id, on_progress figures, add_requests calls) of a submit of ``bodies``: the figures are
    the entries sent when each chunk was, so with the calls they show where chunks were cut."""
    client.redis.config_set("slowlog-log-slower-than", 0)
    client.redis.config_set("slowlog-max-len", 10_000)
    client.redis.slowlog_reset()
    seen: list[int] = []
    job = client.submit(iter(bodies), on_progress=seen.append, **kwargs)
    return job, seen, add_requests_calls(client)


def test_entries_are_the_protocols_entries_in_order(client):
    bodies = [json.dumps({"custom_id": f"c{i}", "prompt": "é😀 " * i}, ensure_ascii=False) for i in range(5)]
    bodies.insert(2, "x" * (client.settings.max_line_bytes + 1))  # answered at once: idx 2 is skipped
    job, seen, calls = submit(client, bodies, model="m")
    entries = stream(client)
    assert entries[0][:6] == [(b"v", b"1"), (b"op", b"open"), (b"job", job.encode()), (b"model", b"m"),
                              (b"completion_window", b"86400"), (b"priority", b"0")]
    assert entries[1:-1] == [protocol_entry(job, idx, idx + 1, bodies[idx]) for idx in (0, 1, 3, 4, 5)]
    assert entries[-1] == [(b"v", b"1"), (b"op", b"close"), (b"job", job.encode()), (b"total", b"6")]
    assert (seen, calls) == ([6], 1)
    # byte for byte what a producer's own XADDs of the same entries write
    for fields in entries:
        client.redis.xadd("{e}:reference", dict(fields))
    assert [list(f.items()) for _, f in client.redis.xrange("{e}:reference")] == entries


def test_a_chunk_is_cut_by_its_bodies_bytes_as_well_as_by_its_count(client, monkeypatch):
    monkeypatch.setattr("batchinfer.client.client.SUBMIT_CHUNK", 4)
    monkeypatch.setattr("batchinfer.client.client.SUBMIT_CHUNK_BYTES", 250)
    small = [json.dumps({"prompt": f"{i:03d}"}) for i in range(9)]  # 17 bytes: cut at 4 entries
    # 82 characters, 142 bytes in UTF-8: two are over the limit in bytes, not in characters
    large = [json.dumps({"prompt": "é" * 60, "n": i}, ensure_ascii=False) for i in range(6)]
    huge = json.dumps({"prompt": "z" * 1000})  # over the limit alone: a chunk of its own
    bodies = [*small, *large, huge, small[0]]
    job, seen, calls = submit(client, bodies)
    # 4 + 4 by count; small + 2 large, 2 large, 2 large by bytes; the huge one; the last one, sent
    # with the close
    assert (seen, calls) == ([4, 8, 11, 13, 15, 16, 17], 7)
    entries = stream(client)
    assert entries[1:-1] == [protocol_entry(job, idx, idx + 1, body) for idx, body in enumerate(bodies)]
    assert entries[-1] == [(b"v", b"1"), (b"op", b"close"), (b"job", job.encode()), (b"total", b"17")]
    # the scheduler takes them all in, as a producer's
    from batchinfer.scheduler.daemon import SchedulerDaemon

    sched = SchedulerDaemon(client.redis, client.settings)
    while sched.run_once():
        pass
    assert client.status(job).submitted == 17


def test_an_interrupted_submit_has_sent_its_whole_chunks_only(client, monkeypatch):
    monkeypatch.setattr("batchinfer.client.client.SUBMIT_CHUNK", 3)

    def records():
        for i in range(5):
            yield {"prompt": f"p{i}"}
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        client.submit(records())
    entries = stream(client)
    # `op open` and the first chunk went out together; the two lines of the unfinished chunk and
    # the close never did
    assert [dict(f).get(b"op") for f in entries] == [b"open", None, None, None]
    assert [dict(f)[b"idx"] for f in entries[1:]] == [b"0", b"1", b"2"]


def test_a_large_submit_goes_in_chunks_of_submit_chunk_entries(client):
    bodies = [json.dumps({"prompt": str(i)}) for i in range(SUBMIT_CHUNK + 500)]
    job, seen, calls = submit(client, bodies)
    assert (seen, calls) == ([SUBMIT_CHUNK, SUBMIT_CHUNK + 500], 2)
    entries = stream(client)
    assert entries[1:-1] == [protocol_entry(job, idx, idx + 1, body) for idx, body in enumerate(bodies)]


def test_the_script_adds_nothing_when_sizes_and_bodies_disagree(client):
    add = scripts.register(client.redis, "add_requests")
    assert add(keys=["{e}:s"], args=["1", "j", "0 1 2 1 2 3", b"abcde"]) == 2
    assert [list(f.items()) for _, f in client.redis.xrange("{e}:s")] == [
        protocol_entry("j", 0, 1, "ab"), protocol_entry("j", 1, 2, "cde")]
    with pytest.raises(redis.ResponseError, match="2 entries of 5 bytes for bodies of 6 bytes"):
        add(keys=["{e}:s"], args=["1", "j", "2 3 2 3 4 3", b"abcdef"])
    assert client.redis.xlen("{e}:s") == 2
