"""Every Redis key name batchinfer uses, built in one place (see docs/protocol.md).

All keys share one prefix holding a hash tag (``{bi}`` by default), so they map to one slot on
Redis Cluster and Lua scripts may touch any of them.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULER_GROUP = "scheduler"
WORKERS_GROUP = "workers"
RQ_QUEUE = "batchinfer"
DIRECT = "direct"  # pseudo job of requests sent without a job id


@dataclass(frozen=True)
class Keys:
    """Key builder for one prefix, e.g. ``Keys("{bi}").job("j1") == "{bi}:job:j1"``."""

    prefix: str = "{bi}"

    def __post_init__(self) -> None:
        if not self.prefix or any(c.isspace() for c in self.prefix):
            raise ValueError(f"prefix must be a non-empty string without spaces, got {self.prefix!r}")

    def _k(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    @property
    def requests(self) -> str:
        return self._k("requests")

    def batches(self, model: str) -> str:
        return self._k("batches", model)

    def results(self, job_id: str) -> str:
        return self._k("results", job_id)

    def job(self, job_id: str) -> str:
        return self._k("job", job_id)

    @property
    def jobs(self) -> str:
        return self._k("jobs")

    def published(self, job_id: str) -> str:
        return self._k("published", job_id)

    def published_direct(self, request_id: str) -> str:
        return self._k("published", DIRECT, request_id)

    def attempts(self, job_id: str) -> str:
        return self._k("attempts", job_id)

    @property
    def deadletter(self) -> str:
        return self._k("deadletter")

    def worker(self, name: str) -> str:
        return self._k("worker", name)

    @property
    def scheduler_owner(self) -> str:
        """The token of the scheduler that does the queue's work now (the others stand by)."""
        return self._k("scheduler", "owner")

    @property
    def scheduler_epoch(self) -> str:
        """A counter bumped whenever the ownership changes hands: the fence of the owner's writes."""
        return self._k("scheduler", "epoch")

    @property
    def schedulers(self) -> str:
        """Hash: each scheduler's token -> its last announcement (owner or standby, when)."""
        return self._k("schedulers")

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

    def idempotency(self, client_request_id: str) -> str:
        return self._k("idempotency", client_request_id)

    def redelivery(self, request_id: str) -> str:
        """Hash of a request sent with a ``client_request_id``: its original ``reply_to``, the retries'
        reply streams, and (once published) a copy of its row, for retries to other reply streams."""
        return self._k("redelivery", request_id)

    @property
    def cancelled(self) -> str:
        return self._k("cancelled")

    def reply(self, token: str) -> str:
        """A client's private reply stream (``Client.request`` / ``requests``)."""
        return self._k("reply", token)

    def is_reply(self, name: str) -> bool:
        """Whether ``name`` is a key of the reply namespace (``{p}:reply:<token>``, token non-empty):
        the only keys a producer's ``reply_to`` may name (docs/protocol.md, rules for producers)."""
        return name.startswith(self.reply("")) and len(name) > len(self.reply(""))

    def queue(self, model: str, member: str) -> str:
        """Staging stream of one ``<priority>:<job>`` member of ``model``'s queue."""
        return self._k("queue", model, member)

    def queues(self, model: str) -> str:
        """Sorted set of ``model``'s active staging streams, scored by priority."""
        return self._k("queues", model)

    @property
    def held(self) -> str:
        """Holding area of requests for models no worker serves yet."""
        return self._k("held")

    @property
    def held_models(self) -> str:
        """Hash: model name -> requests held for it now (job and direct requests together)."""
        return self._k("held_models")

    def admitted(self, job_id: str) -> str:
        """Bitmap: bit ``idx`` set once the scheduler took in an entry for request ``idx`` of the job."""
        return self._k("admitted", job_id)

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
