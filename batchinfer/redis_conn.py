"""Redis connections from URLs: ``redis://``, ``rediss://`` (TLS, CA file), ``unix://``, ACL users,
and Redis behind Sentinel.

``redis+sentinel://[[USER]:PASSWORD@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB][?sentinel_password=P]``
names the sentinels (at least one), the monitored service (``sentinel monitor SERVICE ...`` in
their configuration) and the database (default 0); ``rediss+sentinel://`` speaks TLS to the
sentinels and the servers. The user and password are the data servers'; sentinels that want one
of their own get ``sentinel_password``. The client asks the sentinels for the current master
whenever it (re)connects, so after a failover the next retried command reaches the promoted
replica (redis-py's ``Sentinel`` / ``SentinelConnectionPool``).

A Redis Cluster is reached from any node's ``redis://`` or ``rediss://`` URL through redis-py's
``RedisCluster`` (:func:`connect` with ``cluster``, asked or detected): commands route by their
keys, and batchinfer keeps every Lua call and MULTI within one slot (docs/protocol.md, Partitions);
:func:`read_groups` reads streams of several slots one XREADGROUP per slot.

Every process (client, CLI, daemons) connects through :func:`connect`, so retries with backoff on
connection errors and the health check interval are the same everywhere. Consumer groups are
created in one place too: :func:`ensure_group`.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast, overload
from urllib.parse import parse_qs, quote, unquote, urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelConnectionPool

if TYPE_CHECKING:
    from redis.typing import KeyT, StreamIdT

DEFAULT_URL = "redis://127.0.0.1:6379/0"
SCHEMES = ("redis", "rediss", "unix", "redis+sentinel", "rediss+sentinel")

# Retries cover a restarting Redis (a few seconds); a daemon's own loop reconnects beyond that
# (paced by a Backoff, below). These stay redis-py's own ExponentialBackoff inside its Retry: that
# one repeats a single command within the call, unseen by the caller, while Backoff paces a whole
# loop that catches the error, resets its state and starts over.
RETRIES = 6
BACKOFF_CAP_S = 2.0
BACKOFF_BASE_S = 0.05
HEALTH_CHECK_INTERVAL_S = 15


def _quiet_handshake() -> dict[str, Any]:
    """Keywords that keep redis-py's connection handshake to commands every server we support
    answers: no CLIENT SETINFO (Redis 7.2+) and no maintenance-notifications handshake (redis-py
    8's "auto" sends one a plain Redis refuses). redis-py ignores those refusals, but when a
    connection dropped mid-handshake (a server restarting) redis-py 8.1 read a refusal as the next
    handshake command's reply and raised it, outside the retried errors: an exporter died so.
    Feature-detected, as ``redis>=5.0`` has neither ``driver_info`` nor maintenance notifications."""
    params = inspect.signature(redis.Redis.__init__).parameters
    quiet: dict[str, Any] = {}
    if "driver_info" in params:
        quiet["driver_info"] = None
    elif "lib_name" in params:
        quiet.update(lib_name=None, lib_version=None)
    if "maint_notifications_config" in params:
        from redis.maint_notifications import MaintNotificationsConfig

        quiet["maint_notifications_config"] = MaintNotificationsConfig(enabled=False)
    return quiet


_QUIET_HANDSHAKE = _quiet_handshake()


def connect(
    url: str | None,
    ca_file: str | None = None,
    decode_responses: bool = False,
    *,
    socket_timeout: float | None = None,
    socket_connect_timeout: float = 5.0,
    cluster: bool | None = False,
) -> redis.Redis:
    """A ``redis.Redis`` for ``url`` (``None``: :data:`DEFAULT_URL`).

    ``rediss://`` verifies the server with ``ca_file`` when given (else the system store); user and
    password in the URL select an ACL user. Commands that fail on a connection error or a timeout
    are retried with exponential backoff. ``socket_timeout`` stays ``None`` by default because the
    daemons use blocking ``XREADGROUP`` calls.

    ``cluster``: True, ``url`` names any node of a Redis Cluster and the client is redis-py's
    ``RedisCluster`` (typed as ``redis.Redis``: every command batchinfer sends routes by its keys,
    each Lua call and MULTI within one partition's slot); None, asked of the server (``INFO
    cluster``; a server that does not answer counts as no cluster); False, a plain client.
    """
    url = url or DEFAULT_URL
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme not in SCHEMES:
        raise ValueError(
            f"Redis URL {redact_url(url)!r}: scheme must be one of redis://, rediss://, unix://, "
            "redis+sentinel://, rediss+sentinel://"
        )
    kwargs: dict = {
        "decode_responses": decode_responses,
        "retry": _TransientRetry(ExponentialBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S), RETRIES),
        "retry_on_error": [redis.exceptions.ConnectionError, redis.exceptions.TimeoutError],
        "health_check_interval": HEALTH_CHECK_INTERVAL_S,
        "socket_timeout": socket_timeout,
        "client_name": "batchinfer",
        **_QUIET_HANDSHAKE,
    }
    if scheme != "unix":
        kwargs["socket_connect_timeout"] = socket_connect_timeout
        kwargs["socket_keepalive"] = True
    if scheme.startswith("rediss") and ca_file:
        kwargs["ssl_ca_certs"] = ca_file
    if scheme in SENTINEL_SCHEMES:
        if cluster:
            raise ValueError(f"Redis URL {redact_url(url)!r}: a Sentinel URL names no Cluster "
                             "(BATCHINFER_REDIS_CLUSTER must be 0 or auto with redis+sentinel://)")
        return sentinel_client(parse_sentinel_url(url), kwargs)
    if cluster and scheme == "unix":
        raise ValueError(f"Redis URL {redact_url(url)!r}: a Cluster is reached over TCP (redis:// or "
                         "rediss://), not a unix socket")
    if cluster is None and scheme != "unix":
        cluster = is_cluster(url, kwargs)
    if cluster:
        return cluster_client(url, kwargs)
    return redis.Redis.from_url(url, **kwargs)


# -- Cluster -------------------------------------------------------------------------------------

# a cluster client's URL and keywords, for own_client (RedisCluster keeps no URL)
_CLUSTER_SOURCES: weakref.WeakKeyDictionary[Any, tuple[str, dict[str, Any]]] = weakref.WeakKeyDictionary()
CLUSTER_PROBE_TIMEOUT_S = 2.0


def is_cluster(url: str, kwargs: dict[str, Any]) -> bool:
    """Whether the server at ``url`` runs in cluster mode (``INFO cluster``); False when it cannot
    be asked (down, or an ACL user without INFO): then the caller's plain client reports what is
    wrong on its first command."""
    limit = CLUSTER_PROBE_TIMEOUT_S
    probe_kwargs = {**kwargs, "retry": Retry(NoBackoff(), 0), "socket_timeout": limit}
    probe_kwargs.pop("retry_on_error", None)
    if "socket_connect_timeout" in kwargs:
        probe_kwargs["socket_connect_timeout"] = min(limit, kwargs["socket_connect_timeout"])
    probe = redis.Redis.from_url(url, **probe_kwargs)
    try:
        return bool(probe.info("cluster").get("cluster_enabled"))
    except redis.RedisError:
        return False
    finally:
        probe.close()


def cluster_client(url: str, kwargs: dict[str, Any]) -> redis.Redis:
    """redis-py's ``RedisCluster`` from any node's ``url``: it learns the slots' masters and follows
    a failover (a MOVED reply, a node that stopped answering: it asks the cluster again)."""
    from redis.cluster import RedisCluster

    options = {k: v for k, v in kwargs.items() if k not in ("retry_on_error", "health_check_interval")}
    client = RedisCluster.from_url(url, **options)
    _CLUSTER_SOURCES[client] = (url, dict(kwargs))
    return cast("redis.Redis", client)


def in_cluster(r: redis.Redis) -> bool:
    """Whether ``r`` is a Redis Cluster client (:func:`connect` with ``cluster``)."""
    from redis.cluster import RedisCluster

    return isinstance(r, RedisCluster)


def master_client(r: redis.Redis, key: str) -> redis.Redis:
    """The plain client of the master that serves ``key``'s slot, on a Cluster (``r`` itself on
    anything else): for a WAIT, which counts the replicas of the connection it is sent on."""
    if not in_cluster(r):
        return r
    cluster = cast(Any, r)
    return cluster.get_redis_connection(cluster.get_node_from_key(key))


def moved_or_down(r: redis.Redis, error: Exception) -> Exception:
    """What to raise for ``error`` of a command sent to one master of a Cluster directly
    (:func:`master_client`): when the slot moved (MOVED, ASK), the cluster is down or busy
    (CLUSTERDOWN, TRYAGAIN) or the master stopped answering, the client's slot map is read again
    and a ``ConnectionError`` returned (callers' backoffs retry those); else ``error`` itself."""
    from redis.exceptions import AskError, ClusterDownError, TryAgainError

    if not isinstance(error, redis.ConnectionError | AskError | ClusterDownError | TryAgainError):
        return error
    with contextlib.suppress(redis.RedisError):
        cast(Any, r).nodes_manager.initialize()
    return redis.ConnectionError(f"Redis Cluster: {type(error).__name__} {error} (the slot map is read "
                                 "again; retried)")


def disconnect(r: redis.Redis) -> None:
    """Drop ``r``'s pooled connections (the next command makes new ones): after a connection error
    a thread's client reconnects from scratch, to the promoted master if there was a failover (on a
    Cluster, its slot map is read again: a pipeline's connection error does not do that)."""
    if in_cluster(r):
        cluster = cast(Any, r)
        cluster.disconnect_connection_pools()
        with contextlib.suppress(redis.RedisError):
            cluster.nodes_manager.initialize()
    else:
        r.connection_pool.disconnect()


def own_client(r: redis.Redis) -> redis.Redis:
    """A client with ``r``'s settings (URL, TLS, timeouts, retries; behind Sentinel, the same
    sentinels and service) on a connection pool of its own, so that one thread's round trips never
    queue behind another's (a blocking XREADGROUP holds its connection for up to its block time)."""
    if in_cluster(r):
        url, kwargs = _CLUSTER_SOURCES[r]
        return cluster_client(url, kwargs)
    pool = r.connection_pool
    # the pool derives these per connection itself (redis-py's maintenance notifications; a
    # Sentinel pool's proxy)
    kwargs = {k: v for k, v in pool.connection_kwargs.items()
              if not k.startswith(("maint_notifications", "orig_")) and k != "connection_pool"}
    if isinstance(pool, SentinelConnectionPool):
        fresh: redis.ConnectionPool = SentinelConnectionPool(
            pool.service_name, pool.sentinel_manager, connection_class=pool.connection_class,
            is_master=pool.is_master, check_connection=pool.check_connection, **kwargs)
    else:
        fresh = type(pool)(connection_class=pool.connection_class, **kwargs)
    return redis.Redis(connection_pool=fresh)


# -- Sentinel ------------------------------------------------------------------------------------


SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
SENTINEL_PORT = 26379


@dataclass(frozen=True)
class SentinelUrl:
    """What a ``redis+sentinel://`` URL says."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_password: str | None = None
    tls: bool = False


def is_sentinel_url(url: str) -> bool:
    return url.split("://", 1)[0].lower() in SENTINEL_SCHEMES


def redact_sentinel_url(url: str) -> str:
    """``url`` with the servers' and the sentinels' passwords replaced by ``***``."""
    scheme, _, rest = url.partition("://")
    netloc, slash, tail = rest.partition("/")
    creds, at, hosts = netloc.rpartition("@")
    if at and ":" in creds:
        netloc = f"{creds.split(':', 1)[0]}:***@{hosts}"
    if "sentinel_password=" in tail:
        path, _, query = tail.partition("?")
        query = "&".join("sentinel_password=***" if q.startswith("sentinel_password=") else q
                         for q in query.split("&"))
        tail = f"{path}?{query}"
    return f"{scheme}://{netloc}{slash}{tail}"


def _host_port(item: str, url: str) -> tuple[str, int]:
    if item.startswith("["):  # [IPv6]:port
        host, _, rest = item[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    else:
        host, _, port_text = item.partition(":")
    if not host:
        raise ValueError(f"Redis URL {url!r}: empty sentinel host in {item!r}")
    if not port_text:
        return host, SENTINEL_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"Redis URL {url!r}: sentinel port must be a number 1-65535, got {port_text!r}")
    return host, int(port_text)


def parse_sentinel_url(url: str) -> SentinelUrl:
    """Parse ``url``; a ``ValueError`` names what is wrong (the password never appears in it)."""
    shown = redact_sentinel_url(url)
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in SENTINEL_SCHEMES:
        raise ValueError(f"Redis URL {shown!r}: not a redis+sentinel:// or rediss+sentinel:// URL")
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    creds, at, hosts = netloc.rpartition("@")
    if not at:
        creds, hosts = "", netloc
    username = password = None
    if creds:
        user, colon, pw = creds.partition(":")
        username = unquote(user) or None
        password = unquote(pw) if colon else None
    sentinels = tuple(_host_port(h.strip(), shown) for h in hosts.split(",") if h.strip())
    if not sentinels:
        raise ValueError(f"Redis URL {shown!r}: name at least one sentinel (HOST:PORT[,HOST:PORT...])")
    parts = [p for p in path.split("/") if p]
    if not parts:
        raise ValueError(f"Redis URL {shown!r}: name the monitored service "
                         f"(redis+sentinel://HOST:PORT/SERVICE[/DB])")
    if len(parts) > 2:
        raise ValueError(f"Redis URL {shown!r}: the path is /SERVICE[/DB], got /{'/'.join(parts)}")
    db = 0
    if len(parts) == 2:
        if not parts[1].isdigit():
            raise ValueError(f"Redis URL {shown!r}: the database must be a number, got {parts[1]!r}")
        db = int(parts[1])
    options = parse_qs(query)
    unknown = sorted(set(options) - {"sentinel_password"})
    if unknown:
        raise ValueError(f"Redis URL {shown!r}: unknown option {unknown[0]!r} (known: sentinel_password)")
    sentinel_password = options.get("sentinel_password", [None])[-1]
    return SentinelUrl(sentinels=sentinels, service=unquote(parts[0]), db=db, username=username,
                       password=password, sentinel_password=sentinel_password,
                       tls=scheme.lower() == "rediss+sentinel")


def _master_for(sentinel_class: Any, target: SentinelUrl, kwargs: dict[str, Any]) -> Any:
    """The client ``sentinel_class`` (redis-py's ``Sentinel``, sync or asyncio) gives for the
    service's master: the data servers' connections take ``kwargs``, the sentinels' their timeouts
    and TLS, and their own password (no retry: ``Sentinel`` tries each sentinel in turn)."""
    server = {**kwargs, "db": target.db, "username": target.username, "password": target.password,
              "ssl": target.tls}  # the Sentinel pool picks its connection class by ssl
    sentinel = {k: v for k, v in kwargs.items()
                if k in ("socket_timeout", "socket_connect_timeout", "socket_keepalive", "ssl_ca_certs",
                         "driver_info", "lib_name", "lib_version", "maint_notifications_config")}
    sentinel["password"] = target.sentinel_password
    if target.tls:
        sentinel["ssl"] = True
    if sentinel.get("socket_timeout") is None:
        sentinel["socket_timeout"] = 5.0  # a hung sentinel must not hang discovery
    manager = sentinel_class(list(target.sentinels), sentinel_kwargs=sentinel, **server)
    return manager.master_for(target.service)


def sentinel_client(target: SentinelUrl, kwargs: dict[str, Any]) -> redis.Redis:
    """A ``redis.Redis`` on the service's current master (followed across failovers)."""
    return _master_for(Sentinel, target, kwargs)


def async_sentinel_client(target: SentinelUrl, kwargs: dict[str, Any]) -> Any:
    """The asyncio twin of :func:`sentinel_client` (the HTTP API's event loop)."""
    from redis.asyncio.sentinel import Sentinel as AsyncSentinel

    return _master_for(AsyncSentinel, target, kwargs)


def ensure_group(r: redis.Redis, stream: str, group: str) -> bool:
    """Create consumer ``group`` on ``stream`` (and the stream) unless it exists; True if created.

    The group starts at id 0, so it also delivers entries XADDed before it existed (a scheduler
    may dispatch before any worker has started, and producers may XADD before the scheduler).
    """
    try:
        r.xgroup_create(stream, group, id="0", mkstream=True)
    except redis.ResponseError as e:
        if "BUSYGROUP" not in str(e):  # BUSYGROUP: another process created it first
            raise
        return False
    return True


def read_group(r: redis.Redis, stream: str, group: str, consumer: str, start: bytes | str, *,
               count: int | None, block_ms: int | None) -> object:
    """XREADGROUP ``count`` entries of one ``stream`` from ``start`` (``">"``: new ones; an id: the
    consumer's own pending ones). A missing group (NOGROUP: the stream was deleted, or Redis
    restarted empty) is created again and nothing is read this time; the caller reads on its next
    pass. The reply is redis-py's, typed by :mod:`batchinfer.store.replies`."""
    try:
        return r.xreadgroup(group, consumer, {stream: start}, count=count, block=block_ms)
    except redis.ResponseError as e:
        if "NOGROUP" not in str(e):
            raise
        ensure_group(r, stream, group)
        return []


def read_groups(r: redis.Redis, starts: Mapping[str, bytes | str], group: str, consumer: str, *,
                count: int | None, block_ms: int | None) -> object:
    """:func:`read_group` over several streams in one XREADGROUP: ``starts`` maps each stream to
    its start id; ``count`` is per stream. A NOGROUP (any of them) creates every missing group and
    reads nothing this time. One stream: the very call :func:`read_group` makes.

    On Redis Cluster one XREADGROUP reads one slot: streams in several slots are read one XREADGROUP
    per slot, pipelined (a round trip per node), and only when none had an entry does the call block,
    on one slot's streams in turn for at most :data:`CLUSTER_BLOCK_MS` (an entry added to another
    slot's streams meanwhile waits that long at most)."""
    if in_cluster(r):
        from redis.cluster import key_slot

        slots: dict[int, dict[str, bytes | str]] = {}
        for stream, start in starts.items():
            slots.setdefault(key_slot(stream.encode()), {})[stream] = start
        if len(slots) > 1:
            return _read_slots(r, list(slots.values()), group, consumer, count=count, block_ms=block_ms)
    try:
        streams: dict[KeyT, StreamIdT] = dict(starts.items())
        return r.xreadgroup(group, consumer, streams, count=count, block=block_ms)
    except redis.ResponseError as e:
        if "NOGROUP" not in str(e):
            raise
        for stream in starts:
            ensure_group(r, stream, group)
        return []


CLUSTER_BLOCK_MS = 100
_block_turn = itertools.count()  # which slot's streams a blocking cluster read waits on next


def _read_slots(r: redis.Redis, slots: list[dict[str, bytes | str]], group: str, consumer: str, *,
                count: int | None, block_ms: int | None) -> list[Any]:
    """:func:`read_groups` on a Cluster, its streams in several slots (``slots``: each one's starts)."""
    pipe = r.pipeline(transaction=False)
    for starts in slots:
        pipe.xreadgroup(group, consumer, dict(starts.items()), count=count)
    got: list[Any] = []
    for starts, reply in zip(slots, pipe.execute(raise_on_error=False), strict=True):
        if isinstance(reply, redis.ResponseError) and "NOGROUP" in str(reply):
            for stream in starts:
                ensure_group(r, stream, group)
        elif isinstance(reply, Exception):
            raise reply
        elif reply:
            got.extend(cast("list[Any]", reply))
    if got or not block_ms:
        return got
    starts = slots[next(_block_turn) % len(slots)]
    return cast("list[Any]", read_groups(r, starts, group, consumer, count=count,
                                         block_ms=min(block_ms, CLUSTER_BLOCK_MS)))


def is_permanent(error: Exception) -> bool:
    """Connection errors that no retry can mend: a wrong password or user, an untrusted certificate."""
    if isinstance(error, redis.exceptions.AuthenticationError):
        return True
    return "certificate verify failed" in str(error)


class _TransientRetry(Retry):
    """redis-py's retry with backoff, minus the errors that are not transient (``is_permanent``):
    those reach the caller at once instead of after every backoff step."""

    def call_with_retry(self, do, fail, *args, **kwargs):
        def do_or_stop():
            try:
                return do()
            except redis.exceptions.ConnectionError as e:
                if is_permanent(e):
                    raise _Permanent(e) from e
                raise

        try:
            return super().call_with_retry(do_or_stop, fail, *args, **kwargs)
        except _Permanent as stop:
            raise stop.error from None


class _Permanent(Exception):
    """Carries a permanent error past the retry loop (it is not one of the retried types)."""

    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error


def redact_url(url: str | None) -> str:
    """``url`` with its password replaced by ``***`` (user names are kept), for logs and output."""
    if not url:
        return ""
    if is_sentinel_url(url):  # several hosts: urlsplit cannot read its netloc's port
        return redact_sentinel_url(url)
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    user = quote(unquote(parts.username), safe="") if parts.username else ""
    netloc = f"{user}:***@{host}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def describe(url: str | None) -> str:
    """A short human description of where a URL points, password redacted."""
    return redact_url(url or DEFAULT_URL)


@overload
def as_text(value: None, errors: str = "strict") -> None: ...
@overload
def as_text(value: bytes | str | int | float, errors: str = "strict") -> str: ...
def as_text(value: object, errors: str = "strict") -> str | None:
    """A Redis reply as text, whether or not the connection decodes responses.

    ``bytes`` are decoded as UTF-8 (``errors`` as for :meth:`bytes.decode`: read-only views pass
    ``"replace"`` so that one stray byte cannot fail a scrape); ``None`` (an absent field or key)
    stays ``None``; a ``str`` is returned as it is, anything else (an integer reply) as ``str()``.
    """
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return value.decode("utf-8", errors)
    return str(value)


class Backoff:
    """The waits of a loop that retries until an outage ends: ``start`` seconds, then ``factor``
    times the previous wait, never more than ``cap``; :meth:`reset` after a try that worked.

    Pure (it never sleeps: the loop waits on its own stop event) and without jitter: each process
    retries on its own connection, so there is no herd of identical clients to spread out.
    """

    def __init__(self, start: float, cap: float, factor: float = 2.0):
        if not 0 < start <= cap:
            raise ValueError(f"backoff needs 0 < start <= cap, got start={start} cap={cap}")
        if factor < 1:
            raise ValueError(f"backoff factor must be >= 1, got {factor}")
        self.start, self.cap, self.factor = start, cap, factor
        self._wait = start

    def next(self) -> float:
        """The wait before the next try (seconds); the one after it is ``factor`` times longer."""
        wait = self._wait
        self._wait = min(self.cap, wait * self.factor)
        return wait

    def reset(self) -> None:
        """Back to ``start``: the last try worked."""
        self._wait = self.start
