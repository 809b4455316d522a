"""A worker's place in the registry: its name claimed, its model (and adapters, aliases) registered.

At start the worker claims its name (a live worker holding it: :class:`WorkerNameTaken`; this
worker's previous run, killed before it unregistered: wait for its registration to expire) and
checks its served model names (one a live worker of another model serves:
:class:`ServedNameTaken`), then registers its model under the canonical name, routes the aliases
to it and registers each LoRA adapter ``NAME`` as model ``BASE:NAME``. The keeper thread calls
:meth:`Registration.register_model` again when Redis lost the model (a restart); ``run``'s end
unregisters the worker.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import redis

from batchinfer.clock import Clock
from batchinfer.keys import Keys
from batchinfer.store.registry import Registry, ServedNameTaken, WorkerNameTaken, adapter_model_name
from batchinfer.workers.engine.interface import WorkerEngine
from batchinfer.workers.service.worker_config import WorkerConfig

log = logging.getLogger(__name__)


@runtime_checkable
class EmbedderInfo(Protocol):
    """What an ``"embed"`` engine has besides :class:`WorkerEngine` (see ``WorkerEngine.task``):
    registered with the model, so the scheduler checks ``dimensions`` against it."""

    embedding_dim: int
    matryoshka: bool


class Registration:
    """Claims ``config.name``, registers ``engine``'s model under ``config``'s served names.

    ``status`` gives the registration's fields (the heartbeat's); ``hard_stop`` ends the wait for
    a dead holder's name; ``clock`` times that wait.
    """

    def __init__(self, r: redis.Redis, keys: Keys, config: WorkerConfig, engine: WorkerEngine, *,
                 capacity: dict[str, Any], tokenizer_files: dict[str, bytes], adapters: list[str],
                 heartbeat_seconds: float, status: Callable[[], dict[str, Any]],
                 hard_stop: threading.Event, clock: Clock):
        assert config.name is not None  # WorkerConfig fills in the default
        self.redis, self.keys, self.config, self.engine = r, keys, config, engine
        self.name, self.model = config.name, config.canonical
        self.instance = uuid.uuid4().hex  # tells this process's registration from another's
        self.claimed = False
        self.capacity, self.tokenizer_files, self.adapters = capacity, tokenizer_files, adapters
        self.heartbeat_seconds, self.status = heartbeat_seconds, status
        self.hard_stop, self.clock = hard_stop, clock
        self.registry = Registry(r, keys)

    def claim_name(self) -> bool:
        """Take this worker's name in ``{p}:worker:<name>``; False only on a hard stop meanwhile.

        A registration held by another process is either a live worker (its heartbeat advances:
        :class:`WorkerNameTaken`) or this worker's previous run, killed before it unregistered
        (it does not: wait for it to expire, at most its TTL of three heartbeats, then take it).
        The name is this worker's own after a Redis blip during the start (same ``instance``).
        """
        beat = self.heartbeat_seconds
        ttl = 3 * beat
        first_beat: int | None = None
        deadline = 0.0
        while not self.claimed:
            holder = self.registry.claim_worker(self.name, self.instance, self.status(), ttl=ttl)
            if holder is None:
                self.claimed = True
                break
            if first_beat is None:
                first_beat = holder.heartbeat_at
                # a live holder beats again within a third of its TTL; a dead one's expires
                wait = max(ttl, self.redis.pttl(self.keys.worker(self.name)) / 1000)
                deadline = self.clock() + wait + beat
                log.warning("worker %s: the name is registered by another process (pid %s on %s); "
                            "waiting up to %.0fs for its heartbeat to expire", self.name,
                            holder.info.get("pid"), holder.info.get("host"), wait)
            elif holder.heartbeat_at != first_beat or self.clock() > deadline:
                raise WorkerNameTaken(
                    f"worker name {self.name!r} is taken by a live worker (pid {holder.info.get('pid')} on "
                    f"{holder.info.get('host')}, serving {holder.model!r}); give this worker another --name")
            if self.hard_stop.wait(min(1.0, max(0.05, beat / 4))):
                return False
        return True

    def check_served_names(self) -> None:
        """:class:`ServedNameTaken` when a live worker of another model serves one of the names."""
        conflicts = self.registry.served_name_conflicts(self.config.served_model_names, self.model, self.name)
        if conflicts:
            raise ServedNameTaken(f"worker {self.name}: {conflicts[0]}; give this worker other "
                                  "--served-model-name values, or stop that worker first")

    def register_model(self) -> None:
        """Register the model under its canonical name and route its aliases to it (also the
        keeper's re-registration after a Redis restart)."""
        eos = list(self.engine.eos_token_ids)
        registry, task = self.registry, self.engine.task
        dim, matryoshka = None, False
        if task == "embed" and isinstance(self.engine, EmbedderInfo):
            dim, matryoshka = self.engine.embedding_dim, bool(self.engine.matryoshka)
        registry.register_model(self.model, self.tokenizer_files, self.capacity, eos, task=task,
                                embedding_dim=dim, matryoshka=matryoshka)
        registry.register_aliases(self.model, self.config.aliases)
        for name in self.adapters:
            model = adapter_model_name(self.model, name)
            registry.register_model(model, self.tokenizer_files, self.capacity, eos, adapter=name)
            registry.register_aliases(model, self._free_adapter_aliases(registry, model, name))

    def _free_adapter_aliases(self, registry: Registry, model: str, name: str) -> list[str]:
        """The aliases of adapter model ``model`` (``NAME``, ``ALIAS:NAME`` per alias of the base)
        no live worker of another model serves; those taken are skipped with a warning: the adapter
        stays reachable as ``BASE:NAME``."""
        free = []
        for alias in [name, *(adapter_model_name(a, name) for a in self.config.aliases)]:
            owner = registry.resolve_alias(alias)
            taken = registry.served_name_conflicts([alias], self.model, self.name)
            if not taken and owner not in (None, model) and registry.live_workers(owner):
                taken = [f"alias {alias!r} routes to model {owner!r}, which a live worker serves"]
            if taken:
                log.warning("worker %s: not serving adapter %r as %r: %s; requests name it %r",
                            self.name, name, alias, taken[0], model)
            else:
                free.append(alias)
        return free

    def unregister(self) -> None:
        """Remove this process's registration, if it claimed the name (a Redis error: it expires)."""
        if self.claimed:
            with contextlib.suppress(redis.RedisError):
                self.registry.unregister_worker(self.name, self.instance)
