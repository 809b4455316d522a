"""The batch streams one worker reads: its model's, and one per LoRA adapter it serves, in every
partition.

An adapter ``NAME`` of canonical model ``BASE`` is served as model ``BASE:NAME``
(:func:`~batchinfer.store.registry.adapter_model_name`), whose batches the scheduler packs on
``{p}:batches:BASE:NAME``. With partitions (``BATCHINFER_PARTITIONS`` > 1) each of those streams
exists once per partition (``{p.i}:batches:...``, :mod:`batchinfer.keys`) and the worker reads them
all. Entry ids of two streams can be equal, so inside the worker (its book, keeper and outbox) a
batch entry is named by a *key*: a base entry's id as it is (``"1700-0"``, so a worker without
adapters or partitions keys exactly as before), an adapter entry's ``"NAME/1700-0"`` (adapter names
hold no ``/``: ``workers.lora_request.check_adapter_name``), and ``@i`` after the id for partition
``i`` > 0 (``"1700-0@2"``, ``"NAME/1700-0@2"``).

:func:`streams_to_read` is the cache-affinity policy: which of those streams a pull reads.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Set

from batchinfer.keys import PARTITION_SEP, Keys
from batchinfer.store.registry import adapter_model_name

KEY_SEP = "/"


def entry_key(adapter: str | None, entry_id: str, partition: int = 0) -> str:
    """The worker's key of entry ``entry_id`` of ``adapter``'s stream (None: the base) in ``partition``."""
    if partition:
        entry_id = f"{entry_id}{PARTITION_SEP}{partition}"
    return entry_id if adapter is None else f"{adapter}{KEY_SEP}{entry_id}"


def split_key(key: str) -> tuple[str | None, str, int]:
    """``(adapter or None, entry id, partition)`` of a key made by :func:`entry_key`."""
    adapter, sep, rest = key.rpartition(KEY_SEP)
    entry_id, psep, partition = rest.partition(PARTITION_SEP)
    return (adapter if sep else None), entry_id, (int(partition) if psep else 0)


class BatchStreams:
    """The base stream of ``model`` and the streams of ``adapters``, in every partition of ``keys``;
    keys to streams and back."""

    def __init__(self, keys: Keys, model: str, adapters: Iterable[str] = ()):
        self.keys, self.model = keys, model
        self.adapters = list(dict.fromkeys(adapters))  # served adapter names, in the engine's order
        if any(KEY_SEP in a or ":" in a or PARTITION_SEP in a or not a for a in self.adapters):
            raise ValueError(f"adapters: names must be non-empty without '/', ':' or '@', "
                             f"got {self.adapters}")
        self.partitions = keys.partitions
        self._where: dict[str, tuple[str | None, int]] = {}  # stream -> (adapter, partition)
        for adapter in (None, *self.adapters):
            for i in range(self.partitions):
                self._where[self.stream(adapter, i)] = (adapter, i)

    def model_of(self, adapter: str | None) -> str:
        """The model name batches of ``adapter`` are routed by: ``model`` or ``model:NAME``."""
        return self.model if adapter is None else adapter_model_name(self.model, adapter)

    def stream(self, adapter: str | None, partition: int = 0) -> str:
        """The batch stream of ``adapter`` (None: the base) in ``partition``; any adapter name, served
        or not (a retried request goes back to its adapter's stream whoever serves it)."""
        return self.keys.part(partition).batches(self.model_of(adapter))

    def streams(self, adapter: str | None) -> list[str]:
        """``adapter``'s stream (None: the base) in every partition, in order."""
        return [self.stream(adapter, i) for i in range(self.partitions)]

    def all(self) -> list[str]:
        """Every stream this worker serves: the base ones first, then each adapter's."""
        return list(self._where)

    def _place(self, stream: str | bytes) -> tuple[str | None, int]:
        name = stream.decode() if isinstance(stream, bytes) else stream
        try:
            return self._where[name]
        except KeyError:
            raise ValueError(f"stream {name!r} is not one of this worker's batch streams "
                             f"({', '.join(self._where)})") from None

    def partition_of(self, stream: str | bytes) -> int:
        """The partition whose stream ``stream`` is; ValueError for another stream."""
        return self._place(stream)[1]

    def adapter_of(self, stream: str | bytes) -> str | None:
        """The adapter whose stream ``stream`` is (None: the base); ValueError for another stream."""
        return self._place(stream)[0]

    def key(self, stream: str | bytes, entry_id: str | bytes) -> str:
        """The key of entry ``entry_id`` read from ``stream``."""
        eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
        adapter, partition = self._place(stream)
        return entry_key(adapter, eid, partition)

    def stream_of(self, key: str) -> str:
        """The stream the entry keyed ``key`` is on."""
        adapter, _, partition = split_key(key)
        return self.stream(adapter, partition)

    def by_stream(self, keys: Iterable[str]) -> dict[str, list[str]]:
        """Entry ids grouped by their stream (in the order first seen, ids in the order given)."""
        out: dict[str, list[str]] = {}
        for key in keys:
            adapter, entry_id, partition = split_key(key)
            out.setdefault(self.stream(adapter, partition), []).append(entry_id)
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
