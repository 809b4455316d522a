"""``LoRAManager``: which adapters the engine serves, which are loaded on the host, which sit in
the forward's weight slots, and the step scheduler's admission gate for them.

Three tiers. *Served*: name -> PEFT folder, each checked once by ``load_adapter`` when
registered. *Host*: loaded ``LoRAAdapter`` objects, an LRU of ``max_cpu_loras`` (None: all
served ones); an adapter evicted from it is read again from its folder on a background thread,
so a step never waits for the disk. *Slots*: the ``max_loras`` slots of the ``LoRAStack``; a slot
counts the running sequences that use it (``refs``) and is never evicted while any does; among
the others the least recently used is reused first, so an adapter stays in its slot for later
requests until another one needs the room.

The scheduler asks ``can_admit`` before admitting a waiting sequence, and reports
``admitted`` / ``released``; copying an adapter into a slot on admission is the only work a
load adds to a step. A background load that fails is recorded in ``failed`` (name -> message)
for the engine to end the requests waiting for it.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from batchinfer.workers.engine_config import LoRAConfig
from batchinfer.workers.lora.adapter import ADAPTER_CONFIG, LoRAAdapter, load_adapter
from batchinfer.workers.lora.stack import LoRAStack
from batchinfer.workers.lora_request import LoRARequest, check_adapter_name
from batchinfer.workers.models.model_config import ModelConfig

if TYPE_CHECKING:
    from batchinfer.workers.engine.sequence import Sequence

DEFAULT_MAX_RANK = 16


def largest_rank(paths: list[str]) -> int:
    """The largest rank (``r`` or a ``rank_pattern`` value) of the adapters' configs; 16 when
    none can be read (an unreadable adapter is reported by ``load_adapter`` at registration)."""
    ranks = [DEFAULT_MAX_RANK] if not paths else []
    for path in paths:
        try:
            cfg = json.loads((Path(path) / ADAPTER_CONFIG).read_text(encoding="utf-8"))
            pattern = cfg.get("rank_pattern") or {}
            ranks += [int(r) for r in (cfg["r"], *pattern.values())]
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    return max(ranks, default=DEFAULT_MAX_RANK)


class LoRAManager:
    """The served adapters of one engine and where each one is loaded."""

    def __init__(self, config: LoRAConfig, model_config: ModelConfig, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        c = config
        self.model_config = model_config
        self.dtype = dtype
        self.max_loras = c.max_loras
        self.max_cpu_loras = c.max_cpu_loras  # None: every served adapter stays on the host
        self.max_rank = c.max_lora_rank or largest_rank(list(c.lora_modules.values()))
        self.stack = LoRAStack(model_config, c.max_loras, self.max_rank, dtype, device)
        self.paths: dict[str, str] = {}  # served: name -> folder
        self.roots: dict[str, bytes] = {}  # name -> parent hash of its sequences' first KV block
        self.host: OrderedDict[str, LoRAAdapter] = OrderedDict()  # least recently used first
        self.loading: dict[str, Future[LoRAAdapter]] = {}
        self.failed: dict[str, str] = {}  # background loads that failed: name -> message
        self.slot_names: list[str | None] = [None] * c.max_loras
        self.refs = [0] * c.max_loras  # running sequences using each slot
        self.slot_of_name: dict[str, int] = {}
        self.slot_lru: OrderedDict[int, None] = OrderedDict.fromkeys(range(c.max_loras))
        self.num_loads = 0  # adapters read from disk (registration and reloads)
        self.num_slot_loads = 0  # adapters copied into a slot
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-load")
        try:
            for name, path in c.lora_modules.items():
                self.register(name, path)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop the loader thread (loads under way are abandoned)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- served adapters ------------------------------------------------------------------------

    def register(self, name: str, path: str) -> None:
        """Serve the adapter in folder ``path`` as ``name``: read and checked now (``ValueError``
        from ``load_adapter``). Registering a name again with the same folder does nothing."""
        check_adapter_name(name)
        known = self.paths.get(name)
        if known is not None:
            if _same_path(known, path):
                return
            raise ValueError(f"lora: adapter {name!r} is served from {known}; it cannot also come "
                             f"from {path}")
        adapter = self._load(name, path)
        self.paths[name] = path
        # Its own chain of KV block hashes: the same prompt under two adapters shares no blocks.
        self.roots[name] = hashlib.blake2b(f"lora\0{name}\0{path}".encode(), digest_size=16).digest()
        self._put_host(adapter)

    def resolve(self, lora: str | LoRARequest) -> str:
        """The served name a request's ``lora`` stands for (a ``LoRARequest`` is registered on
        first use); ``ValueError`` for a name this engine does not serve."""
        if isinstance(lora, LoRARequest):
            self.register(lora.lora_name, lora.lora_path)
            return lora.lora_name
        if not isinstance(lora, str):
            raise ValueError(f"lora must be an adapter name or a LoRARequest, got {type(lora).__name__}")
        if lora not in self.paths:
            raise ValueError(not_served_message(lora, self.served()))
        return lora

    def served(self) -> list[str]:
        return sorted(self.paths)

    def resident(self) -> list[str]:
        """Adapters in a slot of the forward's weights now."""
        return sorted(self.slot_of_name)

    # -- the scheduler's gate -------------------------------------------------------------------

    def can_admit(self, seq: Sequence) -> bool:
        """Whether ``seq`` can start running now: it needs no adapter, or its adapter is in a
        slot, or it is on the host and a slot is free or unused. An adapter not on the host
        starts loading in the background (the sequence waits for it)."""
        name = seq.lora
        if name is None or name in self.slot_of_name:
            return True
        if name not in self.host:
            self._poll(name)
            if name not in self.host:
                return False
        return any(refs == 0 for refs in self.refs)

    def admitted(self, seq: Sequence) -> None:
        """``seq`` runs from this step: its adapter gets a slot (copied in if not there yet)."""
        name = seq.lora
        if name is None:
            return
        slot = self.slot_of_name.get(name)
        if slot is None:
            slot = next(s for s in self.slot_lru if self.refs[s] == 0)  # can_admit made sure of one
            old = self.slot_names[slot]
            if old is not None:
                del self.slot_of_name[old]
            self.stack.load(slot, self.host[name])
            self.slot_names[slot], self.slot_of_name[name] = name, slot
            self.num_slot_loads += 1
        if name in self.host:
            self.host.move_to_end(name)
        self.slot_lru.move_to_end(slot)
        self.refs[slot] += 1
        seq.lora_slot = slot

    def released(self, seq: Sequence) -> None:
        """``seq`` stopped running (preempted or finished); its adapter stays in the slot."""
        if seq.lora_slot >= 0:
            self.refs[seq.lora_slot] -= 1
            seq.lora_slot = -1

    def root(self, name: str) -> bytes:
        return self.roots[name]

    # -- background loads -----------------------------------------------------------------------

    @property
    def num_loading(self) -> int:
        return len(self.loading)

    def wait(self, timeout: float) -> None:
        """Block until a background load finishes or ``timeout`` seconds pass (for an engine
        with nothing else to run). The result is taken in by the next ``can_admit`` of its
        adapter, in queue order, so loads finishing together do not evict one another first."""
        pending = [f for f in self.loading.values() if not f.done()]
        if pending:
            wait_futures(pending, timeout=timeout, return_when="FIRST_COMPLETED")

    def take_failed(self) -> dict[str, str]:
        """The failed loads since the last call (a later request for the adapter tries again)."""
        failed, self.failed = self.failed, {}
        return failed

    def _poll(self, name: str) -> None:
        """Take in the background load of ``name`` if it has finished, else start it (unless its
        last one failed and the engine has not taken the failure yet)."""
        future = self.loading.get(name)
        if future is None:
            if name in self.failed:
                return
            self.loading[name] = self._pool.submit(self._load, name, self.paths[name])
            return
        if not future.done():
            return
        del self.loading[name]
        try:
            self._put_host(future.result())
        except Exception as e:  # noqa: BLE001 - the engine ends the requests waiting for it
            self.failed[name] = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"

    def _load(self, name: str, path: str) -> LoRAAdapter:
        adapter = load_adapter(name, path, self.model_config, max_rank=self.max_rank, dtype=self.dtype)
        self.num_loads += 1
        return adapter

    def _put_host(self, adapter: LoRAAdapter) -> None:
        self.host[adapter.name] = adapter
        self.host.move_to_end(adapter.name)
        if self.max_cpu_loras is not None:
            while len(self.host) > self.max_cpu_loras:
                self.host.popitem(last=False)


def not_served_message(name: str, served: list[str]) -> str:
    which = f"it serves: {', '.join(served)}" if served else "it serves no adapters"
    return f"lora: adapter {name!r} is not served by this engine; {which}"


def _same_path(a: str, b: str) -> bool:
    return a == b or Path(a).resolve() == Path(b).resolve()
