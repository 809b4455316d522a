"""The batch streams one worker reads: its model's, and one per LoRA adapter it serves.

An adapter ``NAME`` of canonical model ``BASE`` is served as model ``BASE:NAME``
(:func:`~batchinfer.store.registry.adapter_model_name`), whose batches the scheduler packs on
``{p}:batches:BASE:NAME``. Entry ids of two streams can be equal, so inside the worker (its
book, keeper and outbox) a batch entry is named by a *key*: a base entry's id as it is
(``"1700-0"``, so a worker without adapters keys exactly as before), an adapter entry's
``"NAME/1700-0"`` (adapter names hold no ``/``: ``workers.lora_request.check_adapter_name``).

:func:`streams_to_read` is the cache-affinity policy: which of those streams a pull reads.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Set

from batchinfer.keys import Keys
from batchinfer.store.registry import adapter_model_name

KEY_SEP = "/"


def entry_key(adapter: str | None, entry_id: str) -> str:
    """The worker's key of entry ``entry_id`` of ``adapter``'s stream (None: the base stream)."""
    return entry_id if adapter is None else f"{adapter}{KEY_SEP}{entry_id}"


def split_key(key: str) -> tuple[str | None, str]:
    """``(adapter or None, entry id)`` of a key made by :func:`entry_key`."""
    adapter, sep, entry_id = key.rpartition(KEY_SEP)
    return (adapter, entry_id) if sep else (None, key)


class BatchStreams:
    """The base stream of ``model`` and the streams of ``adapters``; keys to streams and back."""

    def __init__(self, keys: Keys, model: str, adapters: Iterable[str] = ()):
        self.keys, self.model = keys, model
        self.adapters = list(dict.fromkeys(adapters))  # served adapter names, in the engine's order
        if any(KEY_SEP in a or ":" in a or not a for a in self.adapters):
            raise ValueError(f"adapters: names must be non-empty without '/' or ':', got {self.adapters}")
        self.base = keys.batches(model)
        self._adapter_of: dict[str, str | None] = {self.base: None}
        for name in self.adapters:
            self._adapter_of[self.stream(name)] = name

    def model_of(self, adapter: str | None) -> str:
        """The model name batches of ``adapter`` are routed by: ``model`` or ``model:NAME``."""
        return self.model if adapter is None else adapter_model_name(self.model, adapter)

    def stream(self, adapter: str | None) -> str:
        """The batch stream of ``adapter`` (None: the base); any adapter name, served or not (a
        retried request goes back to its adapter's stream whoever serves it)."""
        return self.keys.batches(self.model_of(adapter))

    def all(self) -> list[str]:
        """Every stream this worker serves: the base first, then one per adapter."""
        return list(self._adapter_of)

    def adapter_of(self, stream: str | bytes) -> str | None:
        """The adapter whose stream ``stream`` is (None: the base); ValueError for another stream."""
        name = stream.decode() if isinstance(stream, bytes) else stream
        try:
            return self._adapter_of[name]
        except KeyError:
            raise ValueError(f"stream {name!r} is not one of this worker's batch streams "
                             f"({', '.join(self._adapter_of)})") from None

    def key(self, stream: str | bytes, entry_id: str | bytes) -> str:
        """The key of entry ``entry_id`` read from ``stream``."""
        eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
        return entry_key(self.adapter_of(stream), eid)

    def stream_of(self, key: str) -> str:
        """The stream the entry keyed ``key`` is on."""
        return self.stream(split_key(key)[0])

    def by_stream(self, keys: Iterable[str]) -> dict[str, list[str]]:
        """Entry ids grouped by their stream (in the order first seen, ids in the order given)."""
        out: dict[str, list[str]] = {}
        for key in keys:
            adapter, entry_id = split_key(key)
            out.setdefault(self.stream(adapter), []).append(entry_id)
        return out


def streams_to_read(adapters: Iterable[str], resident_here: Set[str],
                    resident_elsewhere: Mapping[str, Set[str]], idle: bool) -> list[str | None]:
    """The adapters (None: the base) whose streams a pull reads: cache affinity.

    Always the base and the adapters loaded in this engine's weights (``resident_here``); an
    adapter loaded nowhere (no other live worker in ``resident_elsewhere``, adapter -> worker
    names) too, else nobody would take its batches; an adapter loaded on another worker only when
    this worker is ``idle`` (nothing waiting or running), so that a batch waits for the worker
    that has its weights loaded while that one is busy, not while capacity sits unused.
    """
    return [None, *(a for a in adapters if a in resident_here or idle or not resident_elsewhere.get(a))]
