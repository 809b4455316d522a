"""Connections: a wrong password fails at once (no retry loop), transient errors are retried."""

from __future__ import annotations

import pytest
import redis
from conftest import RedisServer

from batchinfer.redis_conn import connect, redact_url


@pytest.fixture
def locked_server(tmp_path):
    server = RedisServer(tmp_path, None, "--requirepass", "s3cret").start()
    yield server
    server.stop(kill=True)


def denied_auths(server: RedisServer) -> int:
    admin = redis.Redis(port=server.port, password="s3cret")
    return sum(int(e["count"]) for e in admin.acl_log() if e["reason"] == "auth")  # ACL LOG counts them


def test_wrong_password_is_not_retried(locked_server):
    before = denied_auths(locked_server)
    with pytest.raises(redis.AuthenticationError):
        connect(f"redis://:wrong@127.0.0.1:{locked_server.port}/0").ping()
    assert denied_auths(locked_server) - before == 1  # one attempt, not one per backoff step
    assert connect(f"redis://:s3cret@127.0.0.1:{locked_server.port}/0").ping()


def test_a_restarted_server_is_reached_again(tmp_path):
    server = RedisServer(tmp_path).start()
    r = connect(server.url)
    r.set("k", "v")
    server.stop(kill=True)
    server.start()  # same port: the client reconnects through its retry with backoff
    assert r.ping() and r.get("k") is None  # nothing persisted (--save "")
    server.stop(kill=True)


def test_redact_url_hides_only_the_password():
    assert redact_url("rediss://alice:pw@host:6380/1") == "rediss://alice:***@host:6380/1"
    assert redact_url("redis://host:6379/0") == "redis://host:6379/0"


def test_the_handshake_sends_nothing_the_server_refuses(redis_server):
    """No handshake command a plain or older Redis refuses (CLIENT SETINFO, redis-py 8's
    maintenance notifications): such a refusal could be read as another handshake command's reply
    after a connection dropped mid-handshake."""
    admin = connect(redis_server.url)  # its own handshake refuses nothing either
    admin.config_resetstat()  # the fixture's own client's handshake had refusals
    r = connect(redis_server.url)
    assert r.ping()
    r.connection_pool.disconnect()
    assert r.ping()  # a second handshake on a new connection
    errors = admin.info("errorstats")
    assert errors == {}, errors  # no error reply at all, unknown subcommands included
