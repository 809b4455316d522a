"""API keys of the HTTP API: who a caller is, and that caller's limits.

A key's secret (``bik_`` + 43 url-safe characters: 256 random bits) is shown once, at creation, and
stored only as its SHA-256 digest: the record ``{p}:apikey:<digest>`` holds the key's id, name, times
and limits; ``{p}:apikeys`` maps key ids to digests, for listing and revoking by name. A key's id
(``key_`` + 12 hex) is what its objects are owned by and the tenant its jobs share the scheduler's
fair share under; its name is what logs show. Nothing is cached: a revoke holds from the next request.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import redis

from batchinfer.clock import WALL_MS, WallClock
from batchinfer.keys import Keys
from batchinfer.redis_conn import as_text

if TYPE_CHECKING:
    from redis.typing import EncodableT, FieldT

    from batchinfer.config import Settings

SECRET_PREFIX = "bik_"
MAX_NAME_CHARS = 100
MAX_SECRET_CHARS = 256  # longer "keys" are refused unhashed
LIMITS = ("max_file_bytes", "max_files", "max_queued_requests")
# a key's limit -> the Settings field that holds it for keys that set none
_DEFAULTS = {"max_file_bytes": "api_max_file_bytes", "max_files": "api_max_files_per_key",
             "max_queued_requests": "api_max_queued_requests_per_key"}
_KEY_ID = re.compile(r"key_[0-9a-f]{12}")


@dataclass
class ApiKey:
    """An API key as stored (never its secret). A limit of None means the Settings default."""

    id: str
    name: str
    created_at: int  # ms since the epoch
    revoked_at: int | None = None
    max_file_bytes: int | None = None
    max_files: int | None = None
    max_queued_requests: int | None = None

    @property
    def tenant(self) -> str:
        """The fair-share tenant of this key's jobs: its id."""
        return self.id

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None

    def limit(self, name: str, settings: Settings) -> int:
        """The key's limit ``name`` (one of :data:`LIMITS`): its own, else the settings' default."""
        own: int | None = getattr(self, name)
        return own if own is not None else int(getattr(settings, _DEFAULTS[name]))


ANONYMOUS = ApiKey(id="anonymous", name="anonymous", created_at=0)
"""Every caller when ``api_auth`` is ``"none"``."""


def digest(secret: str) -> str:
    """The SHA-256 hex digest a secret is stored under.

    A fast hash is right here, unlike for passwords: a secret is 256 random bits, so no guess list
    or brute force gets anywhere near it, and slow hashing (bcrypt, argon2) would only cost every
    request its time. Being deterministic, the digest is also the record's key: one lookup.
    """
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def _opt_int(text: str | None) -> int | None:
    return int(text) if text else None


def _parse(raw: dict) -> ApiKey | None:
    if not raw:
        return None
    h = {as_text(k): as_text(v) for k, v in raw.items()}
    return ApiKey(id=h["id"], name=h["name"], created_at=int(h["created_at"]),
                  revoked_at=_opt_int(h.get("revoked_at")),
                  **{limit: _opt_int(h.get(limit)) for limit in LIMITS})


def _record(key: ApiKey) -> dict[FieldT, EncodableT]:
    return {f.name: "" if getattr(key, f.name) is None else getattr(key, f.name) for f in fields(key)}


def _check_name(name: object) -> str:
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"an API key's name must be a non-empty string, got {name!r}")
    if len(name) > MAX_NAME_CHARS:
        raise ValueError(f"an API key's name may be {MAX_NAME_CHARS} characters at most, got {len(name)}")
    if any(not c.isprintable() for c in name):  # names go to logs: no control characters
        raise ValueError(f"an API key's name may not contain control characters: {name!r}")
    if _KEY_ID.fullmatch(name):
        raise ValueError(f"an API key's name may not look like a key id: {name!r}")
    return name


def _check_limits(limits: dict[str, Any]) -> dict[str, int | None]:
    unknown = sorted(set(limits) - set(LIMITS))
    if unknown:
        raise ValueError(f"unknown API key limit(s) {', '.join(unknown)}: the limits are {', '.join(LIMITS)}")
    for name, value in limits.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"{name} must be a non-negative integer or None (the default), got {value!r}")
    return limits


class ApiKeys:
    """The API keys in Redis: create, authenticate, list, revoke, set limits."""

    def __init__(self, redis_client: redis.Redis, keys: Keys, *, clock: WallClock = WALL_MS):
        self.redis = redis_client
        self.keys = keys
        self._clock = clock

    def create(self, name: str, *, max_file_bytes: int | None = None, max_files: int | None = None,
               max_queued_requests: int | None = None) -> tuple[str, ApiKey]:
        """A new key: ``(secret, key)``. The secret is never stored, so it can be shown only now.

        ValueError for a bad name, a bad limit, or a name an unrevoked key already has.
        """
        _check_name(name)
        limits = _check_limits({"max_file_bytes": max_file_bytes, "max_files": max_files,
                                "max_queued_requests": max_queued_requests})
        secret = SECRET_PREFIX + secrets.token_urlsafe(32)
        key = ApiKey(id="key_" + secrets.token_hex(6), name=name, created_at=self._clock(), **limits)
        hashed = digest(secret)
        with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    # every create writes {p}:apikeys: a concurrent one with the same name makes this retry
                    pipe.watch(self.keys.api_keys)
                    if any(k.name == name and not k.revoked for k in self._all(pipe)):
                        raise ValueError(f"an API key named {name!r} already exists (revoke it first)")
                    pipe.multi()
                    pipe.hset(self.keys.api_key(hashed), mapping=_record(key))
                    pipe.hset(self.keys.api_keys, key.id, hashed)
                    pipe.execute()
                    return secret, key
                except redis.WatchError:
                    continue

    def authenticate(self, secret: object) -> ApiKey | None:
        """The key ``secret`` belongs to; None when unknown or revoked. Read from Redis every time."""
        if not isinstance(secret, str) or not secret or len(secret) > MAX_SECRET_CHARS:
            return None
        key = _parse(self.redis.hgetall(self.keys.api_key(digest(secret))))
        return None if key is None or key.revoked else key

    def _all(self, client: Any) -> list[ApiKey]:
        digests = [as_text(d) for d in client.hvals(self.keys.api_keys)]
        found = [_parse(client.hgetall(self.keys.api_key(d))) for d in digests]
        return sorted((k for k in found if k is not None), key=lambda k: (k.created_at, k.id))

    def list(self) -> list[ApiKey]:
        """Every key, revoked ones too, oldest first."""
        digests = [as_text(d) for d in self.redis.hvals(self.keys.api_keys)]
        pipe = self.redis.pipeline(transaction=False)
        for d in digests:
            pipe.hgetall(self.keys.api_key(d))
        found = [_parse(raw) for raw in pipe.execute()]
        return sorted((k for k in found if k is not None), key=lambda k: (k.created_at, k.id))

    def get(self, key_id: str) -> ApiKey | None:
        """The key with this id (revoked ones too); None when there is none."""
        hashed = self.redis.hget(self.keys.api_keys, key_id)
        return None if hashed is None else _parse(self.redis.hgetall(self.keys.api_key(as_text(hashed))))

    def _find(self, name_or_id: str) -> tuple[str, ApiKey]:
        """``(digest, key)`` of the key with this id, else of the unrevoked key with this name, else
        of the latest revoked one with it; KeyError when none."""
        hashed = self.redis.hget(self.keys.api_keys, name_or_id)
        if hashed is not None:
            key = _parse(self.redis.hgetall(self.keys.api_key(as_text(hashed))))
            if key is not None:
                return as_text(hashed), key
        named = [k for k in self.list() if k.name == name_or_id]
        if not named:
            raise KeyError(f"no API key named or with id {name_or_id!r}")
        key = next((k for k in named if not k.revoked), named[-1])
        hashed = self.redis.hget(self.keys.api_keys, key.id)
        if hashed is None:  # revoked and removed meanwhile
            raise KeyError(f"no API key named or with id {name_or_id!r}")
        return as_text(hashed), key

    def revoke(self, name_or_id: str) -> ApiKey:
        """Revoke a key (by id, or by the name of an unrevoked key): refused from the next request on.
        Revoking a revoked key changes nothing. KeyError when there is none."""
        hashed, key = self._find(name_or_id)
        if key.revoked_at is None:
            key.revoked_at = self._clock()
            self.redis.hset(self.keys.api_key(hashed), "revoked_at", key.revoked_at)
        return key

    def set_limits(self, name_or_id: str, **limits: int | None) -> ApiKey:
        """Set some of a key's limits (``max_file_bytes``, ``max_files``, ``max_queued_requests``);
        None puts one back to the Settings default. KeyError when there is no such key."""
        _check_limits(limits)
        hashed, key = self._find(name_or_id)
        if limits:
            self.redis.hset(self.keys.api_key(hashed),
                            mapping={k: "" if v is None else v for k, v in limits.items()})
        for name, value in limits.items():
            setattr(key, name, value)
        return key
