"""Served models and live workers, as registered in Redis (docs/protocol.md).

A worker registers its model once at start (tokenizer files and capacity, so the scheduler can
tokenise and pack without a shared filesystem) and then heartbeats: its ``{p}:worker:<name>`` hash
expires unless refreshed, and ``{p}:workers`` scores names by their last heartbeat.

Names are claimed, not shared: a worker takes its name with :meth:`Registry.claim_worker` (the
hash holds the ``instance`` token of the process that took it), and the names it serves its model
under (canonical name, then aliases in ``{p}:model_aliases``) are checked against the live workers
of other models (:meth:`Registry.served_name_conflicts`). A conflict is a :class:`NameConflict`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import redis

from batchinfer.keys import Keys
from batchinfer.protocol.rows import TASKS, now_ms
from batchinfer.redis_conn import as_text
from batchinfer.store import replies
from batchinfer.workers.lora_request import check_adapter_name
from batchinfer.workers.text.tokenizer_files import TOKENIZER_FILES

if TYPE_CHECKING:
    from redis.typing import EncodableT, FieldT

CAPACITY_FIELDS = ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "kv_tokens")


def _decode(raw: bytes | str) -> Any:
    """Hash values are JSON when not plain strings; plain strings come back as they are."""
    text = as_text(raw)
    try:
        return json.loads(text)
    except ValueError:
        return text


@dataclass(frozen=True)
class ModelInfo:
    """A served model: its tokenizer files (bytes by file name) and the capacity workers advertise.

    ``task`` is what its workers do with it: ``"generate"`` (a registration written before tasks
    existed reads as one) or ``"embed"``, with ``embedding_dim`` (the width of its vectors) and
    ``matryoshka`` (whether a request may ask for fewer ``dimensions``).

    An adapter model (``BASE:NAME``, :func:`adapter_model_name`) has ``adapter`` = NAME, the LoRA its
    requests run with, and ``base_model`` = BASE, the canonical model whose tokenizer it registers.
    """

    name: str
    files: dict[str, bytes]
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_tokens: int
    eos_token_ids: list[int] = field(default_factory=list)
    fingerprint: str = ""  # sha256 of the tokenizer files: changes when the tokenizer does
    registered_at: int = 0
    task: str = "generate"
    embedding_dim: int | None = None
    matryoshka: bool = False
    adapter: str | None = None
    base_model: str | None = None

    @property
    def capacity(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in CAPACITY_FIELDS}


@dataclass(frozen=True)
class WorkerInfo:
    """A live worker: its served model, last heartbeat (ms) and everything else it reported."""

    name: str
    model: str
    heartbeat_at: int
    info: dict[str, Any]

    @property
    def capacity(self) -> dict[str, int]:
        cap = self.info.get("capacity")
        return {k: int(v) for k, v in cap.items()} if isinstance(cap, dict) else {}


class PartitionsMismatch(ValueError):
    """This process's ``BATCHINFER_PARTITIONS`` is not the deployment's (``{p}:partitions``)."""


def check_partitions(r: redis.Redis, keys: Keys) -> None:
    """Record the deployment's partition count when none is (the first scheduler or worker), else
    check this process's against it: another count would route jobs to other keys.
    Raises :class:`PartitionsMismatch`."""
    r.set(keys.partitions_count, keys.partitions, nx=True)
    found = as_text(r.get(keys.partitions_count))
    if found != str(keys.partitions):
        raise PartitionsMismatch(
            f"BATCHINFER_PARTITIONS is {keys.partitions} here, but this deployment ({keys.prefix}) runs "
            f"with {found} ({keys.partitions_count}): every process and producer must use the same "
            "(docs/protocol.md, Partitions)")


class NameConflict(RuntimeError):
    """A worker cannot start under the names it was given (the message says which and what to do)."""


class WorkerNameTaken(NameConflict):
    """Another live worker holds this worker's name (``{p}:worker:<name>`` heartbeats on)."""


class ServedNameTaken(NameConflict):
    """A live worker of another model serves one of this worker's served model names."""


def _worker_info(name: str, raw: dict) -> WorkerInfo:
    """A worker hash as read (bytes -> bytes) as a :class:`WorkerInfo`."""
    info = {as_text(k): _decode(v) for k, v in raw.items()}
    info["model"] = as_text(raw[b"model"]) if b"model" in raw else str(info.get("model", ""))
    return WorkerInfo(name=name, model=info["model"], heartbeat_at=int(info.get("heartbeat_at", 0)),
                      info=info)


def fingerprint(files: dict[str, bytes], task: str = "generate", embedding_dim: int | None = None,
                matryoshka: bool = False, adapter: str | None = None) -> str:
    """sha256 of the tokenizer files, and of the task of an embedding model (a generation model's
    is the files' alone, as before tasks existed) and of an adapter model's adapter (it registers
    its base's files, yet a cache keyed by fingerprint must tell the two apart): caches rebuild
    when any of them changes."""
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + files[name] + b"\0")
    if task != "generate":
        digest.update(f"task\0{task}\0{embedding_dim}\0{int(matryoshka)}\0".encode())
    if adapter is not None:
        digest.update(f"adapter\0{adapter}\0".encode())
    return digest.hexdigest()


def adapter_model_name(base: str, adapter: str) -> str:
    """The model name an adapter's requests are staged and batched under (``{p}:batches:BASE:NAME``):
    ``adapter`` of canonical model ``base``. Workers register it as a model of its own."""
    return f"{base}:{adapter}"


def _adapter_base(name: str, adapter: str, task: str) -> str:
    """BASE of adapter model ``name`` = ``BASE:<adapter>``; ValueError naming what does not fit."""
    check_adapter_name(adapter, f"model {name!r}: adapter")
    base = name.removesuffix(":" + adapter)
    if base == name or not base:
        raise ValueError(f"model {name!r}: an adapter model is named BASE:{adapter} "
                         f"(adapter_model_name), got {name!r}")
    if task != "generate":
        raise ValueError(f"model {name!r}: an adapter model generates (task 'generate'), got task {task!r}")
    return base


def _str_list(value: Any) -> list[str]:
    """A worker info field that holds a list of names (anything else: none)."""
    return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []


class Registry:
    """Read and write model and worker registrations."""

    def __init__(self, redis_client: redis.Redis, keys: Keys):
        self.redis = redis_client
        self.keys = keys

    # models
    def register_model(self, name: str, files: dict[str, bytes], capacity: dict[str, Any],
                       eos_token_ids: list[int] | None = None, *, task: str = "generate",
                       embedding_dim: int | None = None, matryoshka: bool = False,
                       adapter: str | None = None) -> None:
        """Store (or replace) model ``name``: tokenizer ``files`` by file name, and ``capacity``.

        ``capacity`` needs ``max_model_len``, ``max_num_seqs``, ``max_num_batched_tokens`` and
        ``kv_tokens`` (the dict ``Engine.capacity()`` returns); ``eos_token_ids`` may also be in it.
        ``task``: ``"generate"`` or ``"embed"``; an embedding model also gives ``embedding_dim``.
        ``adapter``: ``name`` is the adapter model ``BASE:<adapter>`` (:func:`adapter_model_name`,
        with the base's files and capacity); ``adapter`` and ``base_model`` = BASE are stored with it.
        """
        base_model = _adapter_base(name, adapter, task) if adapter is not None else None
        if task not in TASKS:
            raise ValueError(f"model {name!r}: task must be one of {', '.join(TASKS)}, got {task!r}")
        if task == "embed" and (not isinstance(embedding_dim, int) or embedding_dim <= 0):
            raise ValueError(f"model {name!r}: an embedding model needs a positive embedding_dim, "
                             f"got {embedding_dim!r}")
        if not name or any(c.isspace() for c in name):
            raise ValueError(f"model name must be non-empty without spaces, got {name!r}")
        if "tokenizer.json" not in files:
            raise ValueError(f"model {name!r}: tokenizer files must include tokenizer.json")
        unknown = set(files) - set(TOKENIZER_FILES)
        if unknown:
            raise ValueError(f"model {name!r}: unexpected tokenizer files {sorted(unknown)}")
        missing = [f for f in CAPACITY_FIELDS if f not in capacity]
        if missing:
            raise ValueError(f"model {name!r}: capacity lacks {missing}")
        values = {f: int(capacity[f]) for f in CAPACITY_FIELDS}
        if min(values.values()) <= 0:
            raise ValueError(f"model {name!r}: capacity values must be positive, got {values}")
        eos = eos_token_ids if eos_token_ids is not None else capacity.get("eos_token_ids", [])
        extra: dict[str, str | int] = {"eos_token_ids": json.dumps([int(t) for t in eos]), "task": task,
                                       "fingerprint": fingerprint(files, task, embedding_dim, matryoshka),
                                       "registered_at": now_ms()}
        if task == "embed":
            assert embedding_dim is not None  # checked above
            extra.update(embedding_dim=int(embedding_dim), matryoshka=int(bool(matryoshka)))
        if adapter is not None and base_model is not None:
            extra.update(adapter=adapter, base_model=base_model,
                         fingerprint=fingerprint(files, task, embedding_dim, matryoshka, adapter))
        # joined as pairs: hset's field map is keyed by redis-py's key union, which no dict[str, ...]
        # is (dict keys are invariant); a (str, bytes) pair is a (FieldT, EncodableT) one
        mapping: dict[FieldT, EncodableT] = dict([*files.items(), *values.items(), *extra.items()])
        key = self.keys.model(name)
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(key)  # a re-registration replaces files that are gone
        pipe.hset(key, mapping=mapping)
        pipe.sadd(self.keys.models, name)
        pipe.execute()

    def get_model(self, name: str) -> ModelInfo | None:
        """The registration of model ``name``, or None when no worker registered it."""
        reply = replies.hash_fields(self.redis.hgetall(self.keys.model(name)))
        raw = {as_text(k): v for k, v in reply.items()}
        if not raw or "tokenizer.json" not in raw:
            return None
        return ModelInfo(
            name=name,
            files={f: raw[f] for f in TOKENIZER_FILES if f in raw},
            eos_token_ids=json.loads(raw.get("eos_token_ids", b"[]")),
            fingerprint=as_text(raw.get("fingerprint", b"")),
            registered_at=int(raw.get("registered_at", 0)),
            task=as_text(raw.get("task", b"generate")) or "generate",
            embedding_dim=int(raw["embedding_dim"]) if "embedding_dim" in raw else None,
            matryoshka=raw.get("matryoshka") == b"1",
            adapter=as_text(raw["adapter"]) if "adapter" in raw else None,
            base_model=as_text(raw["base_model"]) if "base_model" in raw else None,
            **{f: int(raw[f]) for f in CAPACITY_FIELDS},
        )

    def model_fingerprint(self, name: str) -> str | None:
        """The tokenizer fingerprint of model ``name`` (cheap: one field), or None if unknown."""
        value = self.redis.hget(self.keys.model(name), "fingerprint")
        return as_text(value)

    def models(self) -> list[str]:
        """Names of every registered model, sorted."""
        return sorted(as_text(m) for m in self.redis.smembers(self.keys.models))

    def adapters_of(self, base: str) -> list[str]:
        """The adapter names registered for canonical model ``base`` (its models ``base:NAME`` whose
        ``base_model`` is ``base``: a model named ``base:x`` may be a base of its own), sorted."""
        names = [m for m in self.models() if m.startswith(base + ":")]
        if not names:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for name in names:
            pipe.hmget(self.keys.model(name), ["base_model", "adapter"])
        return sorted(as_text(adapter) for owner, adapter in pipe.execute()
                      if adapter is not None and as_text(owner) == base)

    # served names: aliases of canonical models
    def register_aliases(self, model: str, aliases: list[str]) -> None:
        """Route requests naming any of ``aliases`` to registered model ``model``.

        Each alias is re-pointed to ``model`` (the caller checked :meth:`served_name_conflicts`); a
        model registered under an alias's name (a stale registration: no live worker serves it) is
        removed, and ``model`` stops being anyone's alias: a name is a model or an alias, never both.
        """
        for alias in aliases:
            if not alias or any(c.isspace() for c in alias) or alias == model:
                raise ValueError(f"model {model!r}: alias must be a name without spaces other than "
                                 f"the model's own, got {alias!r}")
        pipe = self.redis.pipeline(transaction=True)
        pipe.hdel(self.keys.model_aliases, model)
        for alias in aliases:
            pipe.hset(self.keys.model_aliases, alias, model)
            pipe.delete(self.keys.model(alias))
            pipe.srem(self.keys.models, alias)
        pipe.execute()

    def aliases(self) -> dict[str, str]:
        """Every alias -> the canonical model name it routes to."""
        raw = replies.hash_fields(self.redis.hgetall(self.keys.model_aliases))
        return {as_text(k): as_text(v) for k, v in raw.items()}

    def resolve_alias(self, name: str) -> str | None:
        """The canonical model alias ``name`` routes to, or None when it is no alias."""
        return as_text(self.redis.hget(self.keys.model_aliases, name))

    def served_name_conflicts(self, names: list[str], model: str, worker: str) -> list[str]:
        """Why ``worker`` may not serve ``model`` under ``names``: one line per name that a live worker
        of another model serves too (as its model or one of its aliases). Empty: no conflict.

        Only live workers count (first come, first served while it lives): a name left behind by
        workers that are gone is taken over by :meth:`register_aliases` / :meth:`register_model`.
        """
        out = []
        workers = self.live_workers()
        aliases = self.aliases() if any(w.info.get("adapter_models") for w in workers) else {}
        for w in workers:
            adapter_models = _str_list(w.info.get("adapter_models"))
            if w.name == worker or w.model == model or model in adapter_models:
                continue
            # an adapter model's names: itself and the aliases routed to it (NAME, ALIAS:NAME)
            theirs = {w.model, *_str_list(w.info.get("served_model_names")), *adapter_models,
                      *(a for a, m in aliases.items() if m in adapter_models)}
            out += [f"served model name {n!r} is already served by worker {w.name!r} for model {w.model!r}"
                    for n in names if n in theirs]
        return out

    # workers
    def claim_worker(self, name: str, instance: str, info: dict[str, Any], ttl: float) -> WorkerInfo | None:
        """Register worker ``name`` for process ``instance``, unless another instance holds it.

        Returns None when the name is now ``instance``'s (free, or already its own), else the
        holder's registration, untouched (a holder without an ``instance`` field counts as another
        one). Whether the holder is alive is the caller's question: its ``heartbeat_at`` advances.
        """
        key = self.keys.worker(name)
        with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(key)
                    raw = pipe.hgetall(key)
                    if raw and as_text(raw.get(b"instance")) != instance:
                        pipe.unwatch()
                        return _worker_info(name, raw)
                    pipe.multi()
                    self._write_worker(pipe, name, {**info, "instance": instance}, ttl)
                    pipe.execute()
                    return None
                except redis.WatchError:  # the hash changed between WATCH and EXEC: look again
                    continue

    def heartbeat_worker(self, name: str, info: dict[str, Any], ttl: float) -> None:
        """Create or refresh worker ``name`` (``info`` must hold its ``model``); expires after ``ttl`` s.

        String values are stored as they are, anything else as JSON (e.g. ``capacity``, ``load``).
        """
        pipe = self.redis.pipeline(transaction=True)
        self._write_worker(pipe, name, info, ttl)
        pipe.execute()

    def _write_worker(self, pipe: redis.client.Pipeline, name: str, info: dict[str, Any], ttl: float) -> None:
        if not info.get("model"):
            raise ValueError(f"worker {name!r}: info must name its model")
        now = now_ms()
        mapping: dict[FieldT, EncodableT] = {k: v if isinstance(v, str) else json.dumps(v)
                                             for k, v in info.items()}
        mapping["heartbeat_at"] = str(now)
        key = self.keys.worker(name)
        pipe.hset(key, mapping=mapping)
        pipe.pexpire(key, max(1, int(ttl * 1000)))
        pipe.zadd(self.keys.workers, {name: now})

    def unregister_worker(self, name: str, instance: str | None = None) -> None:
        """Remove worker ``name`` at once (a clean shutdown), instead of waiting for its TTL.

        With ``instance``, only that process's registration: a name another process has taken
        since (after this one stalled) stays its.
        """
        key = self.keys.worker(name)
        with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    if instance is not None:
                        pipe.watch(key)
                        held = as_text(pipe.hget(key, "instance"))
                        if held is not None and held != instance:
                            pipe.unwatch()
                            return
                        pipe.multi()
                    pipe.delete(key)
                    pipe.zrem(self.keys.workers, name)
                    pipe.execute()
                    return
                except redis.WatchError:
                    continue

    def live_workers(self, model: str | None = None) -> list[WorkerInfo]:
        """Workers whose registration has not expired (all, or those serving ``model``: as their model
        or as one of their ``adapter_models``, ``BASE:NAME``), by name.

        Names whose hash expired are pruned from ``{p}:workers`` on the way.
        """
        names = [as_text(n) for n in replies.members(self.redis.zrange(self.keys.workers, 0, -1))]
        if not names:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for name in names:
            pipe.hgetall(self.keys.worker(name))
        live, dead = [], []
        for name, raw in zip(names, pipe.execute(), strict=True):
            if not raw:
                dead.append(name)
                continue
            worker = _worker_info(name, raw)
            serves = model is None or worker.model == model
            if serves or model in _str_list(worker.info.get("adapter_models")):
                live.append(worker)
        if dead:
            self.redis.zrem(self.keys.workers, *dead)
        return sorted(live, key=lambda w: w.name)
