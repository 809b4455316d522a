"""Every Redis key name batchinfer uses, built in one place (see docs/protocol.md).

All keys share one prefix holding a hash tag (``{bi}`` by default): with one partition they map to
one slot on Redis Cluster and Lua scripts may touch any of them.

**Partitions** (``BATCHINFER_PARTITIONS`` = P, default 1): the queue's streams split into P
partitions, each under a prefix of its own (:meth:`Keys.partition_prefix`: partition 0 keeps the
prefix as it is, so P = 1 names every key as before; partition ``i`` > 0 puts ``.i`` inside the
hash tag, ``{bi}`` -> ``{bi.1}``). Three kinds of names:

- a **partition's own**: the intake stream, the batch streams, the staging streams and their sets,
  the holding area and its per-model counts, the jobs index, the cancelled set, the dead letters,
  the reply streams, the scheduler ownership lease and its epoch. A :class:`Keys` is a *view* of one
  partition (``partition``, default 0) and names these in it; :meth:`Keys.part` gives another view.
- a **job's**: its record, results, publication guard, attempts and admissions, and the claims and
  redelivery records of its requests' ``client_request_id``, live in the job's partition
  (:func:`partition_of` its id, the same in every view), so that everything one Lua call or MULTI
  touches for a job shares a slot. The direct pseudo-job's (``results:direct``...) live in
  partition 0.
- **registries**, one per deployment under the prefix as it is (partition 0's slot): workers,
  models, schedulers, cancelled direct requests, direct requests' publication guards, the HTTP
  API's records.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import zlib
from dataclasses import dataclass

SCHEDULER_GROUP = "scheduler"
WORKERS_GROUP = "workers"
RQ_QUEUE = "batchinfer"
DIRECT = "direct"  # pseudo job of requests sent without a job id
MAX_PARTITIONS = 1024
PARTITION_SEP = "@"  # a direct request's id outside partition 0: "<intake entry id>@<partition>"


def partition_of(name: str, partitions: int) -> int:
    """The partition of a job id (or a ``client_request_id``): CRC-32 (zlib's, IEEE) of its UTF-8
    bytes modulo ``partitions`` -- one line in any language (docs/protocol.md)."""
    return zlib.crc32(name.encode("utf-8")) % partitions if partitions > 1 else 0


def direct_request_id(entry_id: str, partition: int) -> str:
    """A direct request's id: its intake entry id, with ``@<partition>`` outside partition 0 (two
    partitions' streams may hand out the same entry id)."""
    return entry_id if partition == 0 else f"{entry_id}{PARTITION_SEP}{partition}"


@functools.lru_cache(maxsize=16)
def _partition_prefixes(prefix: str, partitions: int) -> dict[str, int]:
    """Each partition's prefix -> its number (for reading a key name back)."""
    keys = Keys(prefix, partitions)
    return {keys.partition_prefix(i): i for i in range(partitions)}


@dataclass(frozen=True)
class Keys:
    """Key builder for one prefix, e.g. ``Keys("{bi}").job("j1") == "{bi}:job:j1"``; a view of
    partition ``partition`` of ``partitions`` (see the module's docstring)."""

    prefix: str = "{bi}"
    partitions: int = 1
    partition: int = 0

    def __post_init__(self) -> None:
        if not self.prefix or any(c.isspace() for c in self.prefix):
            raise ValueError(f"prefix must be a non-empty string without spaces, got {self.prefix!r}")
        if not isinstance(self.partitions, int) or not 1 <= self.partitions <= MAX_PARTITIONS:
            raise ValueError(f"partitions (BATCHINFER_PARTITIONS) must be an integer from 1 to "
                             f"{MAX_PARTITIONS}, got {self.partitions!r}")
        if not 0 <= self.partition < self.partitions:
            raise ValueError(f"partition must be in 0..{self.partitions - 1}, got {self.partition!r}")

    # -- partitions ---------------------------------------------------------------------------------

    def partition_prefix(self, i: int) -> str:
        """Partition ``i``'s prefix: the prefix itself for 0; else ``.i`` added inside its hash tag
        (``{bi}`` -> ``{bi.3}``), or at its end when it has none (``bi`` -> ``bi.3``)."""
        if i == 0:
            return self.prefix
        open_ = self.prefix.find("{")
        close = self.prefix.find("}", open_ + 1) if open_ >= 0 else -1
        if close > open_ + 1:  # a non-empty tag: the part Redis Cluster hashes
            return f"{self.prefix[:close]}.{i}{self.prefix[close:]}"
        return f"{self.prefix}.{i}"

    def part(self, i: int) -> Keys:
        """The view of partition ``i``."""
        return self if i == self.partition else dataclasses.replace(self, partition=i)

    def parts(self) -> list[Keys]:
        """A view of every partition, in order."""
        return [self.part(i) for i in range(self.partitions)]

    def job_partition(self, job_id: str | None) -> int:
        """The partition a job lives in (direct requests' data: 0)."""
        return 0 if not job_id or job_id == DIRECT else partition_of(job_id, self.partitions)

    def for_job(self, job_id: str | None) -> Keys:
        """The view of the partition whose streams carry ``job_id``'s entries and batches."""
        return self.part(self.job_partition(job_id))

    def direct_id(self, entry_id: str) -> str:
        """The request id of this partition's intake entry ``entry_id`` when it has no job (a direct
        request, an op's answer): :func:`direct_request_id`."""
        return direct_request_id(entry_id, self.partition)

    def for_direct(self, client_request_id: str | None = None) -> Keys:
        """The view of the partition a direct request goes to: its ``client_request_id``'s (so that
        every retry of it meets the first in one scheduler), else one at random."""
        if self.partitions == 1:
            return self
        if client_request_id:
            return self.part(partition_of(client_request_id, self.partitions))
        return self.part(random.randrange(self.partitions))

    def _k(self, *parts: str) -> str:
        """A registry's name (one per deployment)."""
        return ":".join((self.prefix, *parts))

    def _p(self, *parts: str) -> str:
        """A name of this view's partition."""
        return ":".join((self.partition_prefix(self.partition), *parts))

    def _j(self, job_id: str, *parts: str) -> str:
        """A name of ``job_id``'s partition."""
        return ":".join((self.partition_prefix(self.job_partition(job_id)), *parts))

    @property
    def requests(self) -> str:
        return self._p("requests")

    def batches(self, model: str) -> str:
        return self._p("batches", model)

    def results(self, job_id: str) -> str:
        return self._j(job_id, "results", job_id)

    def job(self, job_id: str) -> str:
        return self._j(job_id, "job", job_id)

    @property
    def jobs(self) -> str:
        """Sorted set: the ids of this partition's jobs, scored by creation time (ms)."""
        return self._p("jobs")

    def published(self, job_id: str) -> str:
        return self._j(job_id, "published", job_id)

    def published_direct(self, request_id: str) -> str:
        return self._k("published", DIRECT, request_id)

    def attempts(self, job_id: str) -> str:
        return self._j(job_id, "attempts", job_id)

    @property
    def deadletter(self) -> str:
        """Stream: this partition's dead-lettered requests (a job's: in its partition; direct: 0)."""
        return self._p("deadletter")

    def worker(self, name: str) -> str:
        return self._k("worker", name)

    @property
    def scheduler_owner(self) -> str:
        """The token of the scheduler that does the queue's work now (the others stand by)."""
        return self._p("scheduler", "owner")

    @property
    def scheduler_epoch(self) -> str:
        """A counter bumped whenever the ownership changes hands: the fence of the owner's writes."""
        return self._p("scheduler", "epoch")

    @property
    def schedulers(self) -> str:
        """Hash: each scheduler's token -> its last announcement (owner or standby, when)."""
        return self._k("schedulers")

    @property
    def partitions_count(self) -> str:
        """The deployment's ``BATCHINFER_PARTITIONS``, set by its first scheduler or worker (producers
        may read it; every process refuses to start with another)."""
        return self._k("partitions")

    @property
    def workers(self) -> str:
        return self._k("workers")

    def model(self, name: str) -> str:
        return self._k("model", name)

    @property
    def models(self) -> str:
        return self._k("models")

    @property
    def model_aliases(self) -> str:
        """Hash: served alias -> the canonical model name it routes to (``--served-model-name``)."""
        return self._k("model_aliases")

    def idempotency(self, client_request_id: str, job_id: str | None = None) -> str:
        """A ``client_request_id``'s claim, in the partition where the rows of ``job_id`` (None: of
        direct requests) are published, beside :meth:`redelivery` (one Lua call touches both)."""
        return self._j(job_id or DIRECT, "idempotency", client_request_id)

    def redelivery(self, request_id: str, job_id: str | None = None) -> str:
        """Hash of a request sent with a ``client_request_id``: its original ``reply_to``, the retries'
        reply streams, and (once published) a copy of its row, for retries to other reply streams.
        In the partition of the request's job (direct: 0), so that its publication touches one slot."""
        return self._j(job_id or DIRECT, "redelivery", request_id)

    @property
    def cancelled(self) -> str:
        """Set: this partition's jobs asked to cancel (or expired), until their export."""
        return self._p("cancelled")

    def reply(self, token: str) -> str:
        """A private reply stream in this view's partition (``Client.request`` / ``requests``: 0)."""
        return self._p("reply", token)

    def reply_partition(self, name: str) -> int | None:
        """The partition whose reply namespace ``name`` is in (``<partition prefix>:reply:<token>``,
        the token non-empty), None when it is none's: the only keys a producer's ``reply_to`` may
        name (docs/protocol.md, rules for producers)."""
        head, sep, token = name.partition(":reply:")
        if not sep or not token:
            return None
        return _partition_prefixes(self.prefix, self.partitions).get(head)

    def is_reply(self, name: str) -> bool:
        """Whether ``name`` is a key of any partition's reply namespace (:meth:`reply_partition`)."""
        return self.reply_partition(name) is not None

    def queue(self, model: str, member: str) -> str:
        """Staging stream of one ``<priority>:<job>`` member of ``model``'s queue."""
        return self._p("queue", model, member)

    def queues(self, model: str) -> str:
        """Sorted set of ``model``'s active staging streams, scored by priority."""
        return self._p("queues", model)

    @property
    def held(self) -> str:
        """Holding area of requests for models no worker serves yet."""
        return self._p("held")

    @property
    def held_models(self) -> str:
        """Hash: model name -> requests held for it now in this partition (job and direct requests)."""
        return self._p("held_models")

    def admitted(self, job_id: str) -> str:
        """Bitmap: bit ``idx`` set once the scheduler took in an entry for request ``idx`` of the job."""
        return self._j(job_id, "admitted", job_id)

    # -- the HTTP API (batchinfer/api, docs/api.md) ------------------------------------------------

    def file(self, file_id: str) -> str:
        """Hash: a file-store file's record (owner, name, purpose, size, times, location)."""
        return self._k("file", file_id)

    def files(self, owner: str) -> str:
        """Sorted set: an API key's file ids scored by creation time (ms), for listing."""
        return self._k("files", owner)

    @property
    def files_expiring(self) -> str:
        """Sorted set: file id -> expiry time (unix s) of every file that expires, for the sweep."""
        return self._k("files_expiring")

    def api_key(self, digest: str) -> str:
        """Hash: an API key's record, under the sha256 hex digest of its secret."""
        return self._k("apikey", digest)

    @property
    def api_keys(self) -> str:
        """Hash: API key id -> the digest its record is stored under."""
        return self._k("apikeys")

    def api_batch(self, batch_id: str) -> str:
        """Hash: an API batch's own attributes (its job record holds the rest)."""
        return self._k("apibatch", batch_id)

    def api_batches(self, kind: str, owner: str) -> str:
        """Sorted set: one API key's batches of one kind (openai | anthropic) scored by creation (ms)."""
        return self._k("apibatches", kind, owner)

    @property
    def cancelled_requests(self) -> str:
        """Sorted set: direct request id (intake entry id) -> ms cancelled (a sync caller went away)."""
        return self._k("cancelled", "requests")
