"""Typed configuration. The only module that reads ``BATCHINFER_*`` environment variables, but for
the inference library's kernel switch ``BATCHINFER_CPU_DECODE_KERNEL`` (kernels/cpu_ext/decode.py:
the library imports nothing of this side)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchinfer.keys import Keys

if TYPE_CHECKING:
    import redis

ENV_PREFIX = "BATCHINFER_"
_RQ_CLIENTS: dict[tuple[str, str | None], redis.Redis] = {}  # Settings.connect_rq's, by URL


def _env(name: str, default: Any, cast=str, environ: dict[str, str] | None = None) -> Any:
    raw = (environ if environ is not None else os.environ).get(ENV_PREFIX + name)
    if raw is None or raw == "":
        return default
    try:
        if cast is bool:
            return raw.strip().lower() in ("1", "true", "yes", "on")
        return cast(raw)
    except ValueError:
        raise ValueError(f"{ENV_PREFIX}{name}: cannot read {raw!r} as {cast.__name__}") from None


@dataclass
class Settings:
    """Settings shared by the CLI, the client and the daemons.

    Each field may come from ``BATCHINFER_<FIELD NAME IN CAPITALS>``; command-line flags override.
    """

    # redis://, rediss://, unix://, redis+sentinel://HOST:PORT[,...]/SERVICE[/DB]; None = local default
    redis_url: str | None = None
    redis_ca_file: str | None = None  # CA bundle for rediss:// (and rediss+sentinel://)
    # Redis Cluster: "1" (the URL names any node), "0" (a plain server), "auto" (ask the server once
    # per connection; a server down at start counts as plain: set 1 for daemons of a Cluster)
    redis_cluster: str = "auto"
    # The Redis of rq's export queue; default redis_url. rq's keys span slots: with a Cluster name
    # a plain Redis (or a Sentinel URL) here
    rq_redis_url: str | None = None
    # Replicas that must hold a result row before it counts as published (WAIT after each publish; the
    # batch it completes is acked only then): 0 = off, rows are as safe as Redis' async replication
    replica_acks: int = 0
    replica_ack_timeout_ms: int = 1000  # how long one publish waits for them before it is retried
    prefix: str = "{bi}"  # key prefix with its hash tag
    # Partitions of the queue's streams (keys.py): the same for every process of a deployment; each
    # partition is one scheduler's unit of work, so P > 1 lets several schedulers share the intake
    partitions: int = 1
    lease_seconds: float = 60.0  # a batch not refreshed for this long is re-dispatched
    max_attempts: int = 3  # worker crashes a request survives before it is dead-lettered
    heartbeat_seconds: float = 5.0
    # Several schedulers: one owns the queue's work, the others stand by and take over this long after
    # the owner stopped renewing its lease (it died, hung or was cut off)
    scheduler_takeover_seconds: float = 10.0
    results_root: str = "results"  # local outputs are confined below this folder
    # URI prefixes a job's output may name besides the results root (comma-separated; none by default):
    # producers choose outputs; the exporter writes them with its own rights (protocol/destinations.py)
    output_uri_prefixes: str = ""
    results_ttl_seconds: int = 7 * 24 * 3600  # results stream kept this long after export
    direct_results_retention_seconds: int = 7 * 24 * 3600  # results:direct trims rows older than this
    max_line_bytes: int = 10 * 1024 * 1024  # an input line / intake body longer than this is refused
    max_requests_per_job: int = 50_000_000
    max_tokens_limit: int = 1_000_000  # upper bound on any request's max_tokens
    max_n: int = 128  # upper bound on any request's n (OpenAI's); its sequences hold a worker as n requests
    max_prompt_tokens: int = 1_000_000  # upper bound on any request's prompt tokens (and the model's context)
    direct_hold_seconds: float = 600.0  # how long a direct request waits for its model to be served
    # Structured outputs: the scheduler's limits on one request's schema / regex / grammar / choice list
    # (StructuredLimits' defaults); a spec over one is an invalid_request row, never dispatched.
    structured_max_spec_bytes: int = 64 * 1024
    structured_max_depth: int = 32  # nesting of a JSON schema's objects and lists
    structured_max_choices: int = 1024
    structured_compile_timeout_s: float = 5.0  # wall time the scheduler's check may compile one spec
    # regex work (llguidance lexer fuel) one spec may take: bounds a request's mask cost per step;
    # the workers read it too, so that what the scheduler accepts they can run
    structured_lexer_fuel: int = 100_000
    log_format: str = "human"  # human | json
    log_level: str = "INFO"
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"  # the metrics / health server's address (no auth: loopback by default)
    # The HTTP API (docs/api.md). The file store holds uploads and result files: a local folder or any
    # pyarrow filesystem URI (s3://bucket/prefix); "" = <results_root>/files. See files_root().
    files_dir: str = ""
    files_retention_seconds: int = 30 * 24 * 3600  # uploaded and result files expire after this (0 = never)
    api_auth: str = "keys"  # "keys" | "none" (every caller is the anonymous key)
    api_max_file_bytes: int = 200 * 1024 * 1024  # per upload (OpenAI's 200 MB); a key's own limit overrides
    api_max_files_per_key: int = 10_000
    api_max_queued_requests_per_key: int = 10_000_000  # requests of a key's unfinished batches
    api_max_batch_requests: int = 50_000  # lines per OpenAI batch (OpenAI's)
    api_max_body_bytes: int = 256 * 1024 * 1024  # a JSON request body (Anthropic's batch create: 256 MB)
    api_sync_priority: int = 1000  # synchronous requests go in above batch jobs (default priority 0)
    api_sync_timeout_seconds: float = 600.0
    extra: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: Any) -> Settings:
        """Defaults, then ``BATCHINFER_*`` variables, then non-None ``overrides``."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name == "extra":
                continue
            default = f.default
            cast = type(default) if default is not None else str
            if f.name == "metrics_port":
                cast = int
            values[f.name] = _env(f.name.upper(), default, cast, environ)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def __repr__(self) -> str:
        """As the dataclass's, but with the Redis password redacted (settings may end up in logs)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values["redis_url"] = self.redacted_url()
        if self.rq_redis_url:
            from batchinfer.redis_conn import redact_url

            values["rq_redis_url"] = redact_url(self.rq_redis_url)
        shown = ", ".join(f"{name}={value!r}" for name, value in values.items())
        return f"Settings({shown})"

    def cluster(self) -> bool | None:
        """``redis_cluster`` read: True, False, or None (ask the server)."""
        value = str(self.redis_cluster).strip().lower()
        if value in ("1", "true", "yes", "on"):
            return True
        if value in ("0", "false", "no", "off"):
            return False
        if value in ("", "auto"):
            return None
        raise ValueError(f"BATCHINFER_REDIS_CLUSTER must be 1, 0 or auto, got {self.redis_cluster!r}")

    def connect(self, *, socket_timeout: float | None = None, socket_connect_timeout: float = 5.0,
                decode_responses: bool = False) -> redis.Redis:
        """A client of this deployment's Redis (``redis_url``, TLS, Cluster or not):
        :func:`batchinfer.redis_conn.connect`."""
        from batchinfer.redis_conn import connect

        return connect(self.redis_url, self.redis_ca_file, decode_responses, socket_timeout=socket_timeout,
                       socket_connect_timeout=socket_connect_timeout, cluster=self.cluster())

    def connect_rq(self, data: redis.Redis | None = None) -> redis.Redis:
        """A client of the Redis that holds rq's export queue: ``rq_redis_url``, else the data Redis
        (``data`` when given, reused). rq's keys span Cluster slots: on a Cluster, a ``ValueError``
        says to name a plain Redis in ``BATCHINFER_RQ_REDIS_URL``."""
        from batchinfer.redis_conn import connect, in_cluster

        if self.rq_redis_url:
            source = (self.rq_redis_url, self.redis_ca_file)
            if source not in _RQ_CLIENTS:  # one pool per process, not one per enqueue
                _RQ_CLIENTS[source] = connect(self.rq_redis_url, self.redis_ca_file, cluster=False)
            return _RQ_CLIENTS[source]
        r = data if data is not None else self.connect()
        if in_cluster(r):
            raise ValueError("BATCHINFER_REDIS_URL is a Redis Cluster, where rq (the export queue) cannot "
                             "run: its keys span slots. Name a plain Redis (or a Sentinel URL) for it in "
                             "BATCHINFER_RQ_REDIS_URL")
        return r

    def keys(self) -> Keys:
        """The key names of this deployment (its prefix and partitions), as partition 0's view."""
        return Keys(self.prefix, self.partitions)

    def files_root(self) -> str:
        """The file store's root as a URI: ``file:///abs/path`` for a local folder (``files_dir``, or
        ``<results_root>/files`` when unset, made absolute); any other URI as given."""
        if "://" in self.files_dir:
            return self.files_dir.rstrip("/")
        folder = self.files_dir or os.path.join(self.results_root, "files")
        return Path(os.path.abspath(folder)).as_uri()

    def output_prefixes(self) -> str:
        """The destinations a producer's output may name besides the results root (comma-joined):
        ``output_uri_prefixes`` and the file store, where the exporter writes the API's result files."""
        return ",".join(filter(None, [self.output_uri_prefixes.strip(), self.files_root()]))

    def redacted_url(self) -> str | None:
        """The Redis URL with any password replaced, for logs and status output."""
        from batchinfer.redis_conn import redact_url

        return redact_url(self.redis_url) if self.redis_url else None
