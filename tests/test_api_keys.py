"""API keys (batchinfer/store/apikeys.py) on a real Redis: secrets shown once and stored hashed,
names unique among live keys, revocation effective at once, per-key limits."""

from __future__ import annotations

import hashlib
import threading

import pytest

from batchinfer.keys import Keys
from batchinfer.store.apikeys import ANONYMOUS, ApiKey, ApiKeys


class Clock:
    """A wall clock (ms) that moves one millisecond per reading: creation order is well defined."""

    def __init__(self, start: int = 1_700_000_000_000):
        self.ms = start

    def __call__(self) -> int:
        self.ms += 1
        return self.ms


@pytest.fixture
def api_keys(redis_server):
    return ApiKeys(redis_server.client(), Keys("{t}"), clock=Clock())


def _everything_stored(r) -> bytes:
    """Every key name and value in Redis, concatenated (hashes only: that is all ApiKeys writes)."""
    out = []
    for key in r.scan_iter("*"):
        assert r.type(key) == b"hash"
        out.append(key)
        for field, value in r.hgetall(key).items():
            out += [field, value]
    return b"\n".join(out)


def test_a_secret_authenticates_its_key_and_is_stored_only_as_its_digest(api_keys, redis_server):
    secret, key = api_keys.create("alice")
    assert secret.startswith("bik_") and len(secret) == 4 + 43
    assert key.id.startswith("key_") and len(key.id) == 16 and key.name == "alice"
    assert key.tenant == key.id and key.revoked_at is None
    assert api_keys.authenticate(secret) == key
    stored = _everything_stored(redis_server.client())
    assert secret.encode() not in stored and secret[4:].encode() not in stored
    assert hashlib.sha256(secret.encode()).hexdigest().encode() in stored
    digest = hashlib.sha256(secret.encode()).hexdigest().encode()
    assert redis_server.client().hget("{t}:apikeys", key.id) == digest


@pytest.mark.parametrize("wrong", ["", "bik_", "bik_nope", "x" * 10_000, None, 42, b"bik_bytes"])
def test_unknown_and_malformed_secrets_authenticate_nobody(api_keys, wrong):
    api_keys.create("alice")
    assert api_keys.authenticate(wrong) is None


def test_a_near_miss_of_a_secret_is_refused(api_keys):
    secret, _ = api_keys.create("alice")
    assert api_keys.authenticate(secret[:-1] + ("A" if secret[-1] != "A" else "B")) is None
    assert api_keys.authenticate(secret + "x") is None


def test_revoking_takes_effect_on_the_very_next_authentication_everywhere(api_keys, redis_server):
    secret, key = api_keys.create("alice")
    other_replica = ApiKeys(redis_server.client(), Keys("{t}"))
    assert other_replica.authenticate(secret) == key
    revoked = api_keys.revoke("alice")
    assert revoked.id == key.id and revoked.revoked_at is not None
    assert api_keys.authenticate(secret) is None
    assert other_replica.authenticate(secret) is None


def test_revoke_by_id_and_revoking_twice_changes_nothing(api_keys):
    secret, key = api_keys.create("alice")
    first = api_keys.revoke(key.id)
    again = api_keys.revoke(key.id)
    assert again.revoked_at == first.revoked_at is not None
    assert api_keys.revoke("alice").revoked_at == first.revoked_at  # by the name of a revoked key
    assert api_keys.authenticate(secret) is None


def test_revoking_an_unknown_key_is_a_key_error(api_keys):
    with pytest.raises(KeyError, match="nobody"):
        api_keys.revoke("nobody")
    with pytest.raises(KeyError):
        api_keys.set_limits("nobody", max_files=1)


def test_names_are_unique_among_unrevoked_keys(api_keys):
    old_secret, old = api_keys.create("ci")
    with pytest.raises(ValueError, match="already exists"):
        api_keys.create("ci")
    api_keys.revoke("ci")
    new_secret, new = api_keys.create("ci")
    assert new.id != old.id
    assert api_keys.revoke("ci").id == new.id  # the name now means the live key
    assert api_keys.authenticate(old_secret) is None and api_keys.authenticate(new_secret) is None


def test_concurrent_creates_of_one_name_make_one_key(api_keys, redis_server):
    barrier = threading.Barrier(6)
    outcomes: list[object] = []

    def create() -> None:
        mine = ApiKeys(redis_server.client(), Keys("{t}"))
        barrier.wait()
        try:
            outcomes.append(mine.create("shared")[1])
        except ValueError as e:
            outcomes.append(e)

    threads = [threading.Thread(target=create) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(isinstance(o, ApiKey) for o in outcomes) == 1
    assert [k.name for k in api_keys.list()] == ["shared"]


@pytest.mark.parametrize("name", ["", "   ", "a\nb", "tab\there", "x" * 101, "key_0123456789ab", None])
def test_bad_names_are_refused(api_keys, name):
    with pytest.raises(ValueError, match="name"):
        api_keys.create(name)
    assert api_keys.list() == []


def test_list_shows_every_key_oldest_first_revoked_too_and_never_a_secret(api_keys):
    secrets_ = [api_keys.create(name)[0] for name in ("a", "b", "c")]
    api_keys.revoke("b")
    listed = api_keys.list()
    assert [k.name for k in listed] == ["a", "b", "c"]
    assert [k.revoked_at is not None for k in listed] == [False, True, False]
    assert listed[0].created_at < listed[1].created_at < listed[2].created_at
    assert not any(s in repr(listed) for s in secrets_)


def test_limits_are_set_at_creation_changed_later_and_reset_with_none(api_keys):
    secret, key = api_keys.create("team", max_file_bytes=1000, max_files=5)
    assert (key.max_file_bytes, key.max_files, key.max_queued_requests) == (1000, 5, None)
    changed = api_keys.set_limits("team", max_queued_requests=7, max_file_bytes=None)
    assert (changed.max_file_bytes, changed.max_files, changed.max_queued_requests) == (None, 5, 7)
    seen = api_keys.authenticate(secret)
    assert seen is not None
    assert (seen.max_file_bytes, seen.max_files, seen.max_queued_requests) == (None, 5, 7)
    assert api_keys.set_limits(key.id, max_files=0).max_files == 0


@pytest.mark.parametrize("limits", [{"max_bytes": 1}, {"max_files": -1}, {"max_files": "5"},
                                    {"max_files": True}])
def test_bad_limits_are_refused(api_keys, limits):
    api_keys.create("team")
    with pytest.raises(ValueError):
        api_keys.set_limits("team", **limits)
    with pytest.raises((ValueError, TypeError)):
        api_keys.create("other", **limits)


def test_the_anonymous_key_is_its_own_tenant():
    assert ANONYMOUS.id == ANONYMOUS.name == ANONYMOUS.tenant == "anonymous"
    assert ANONYMOUS.revoked_at is None and ANONYMOUS.max_files is None
