"""Job control entries (``v 1 op open|close|cancel job J ...``), applied by the scheduler in stream order.

A producer in any language runs a job with intake entries alone (docs/protocol.md, "Jobs"):
``op open`` creates the record (``open_job.lua``; the Python client runs the same script first, so
``status`` reads the job at once, and its ``op open`` is then a no-op), request entries follow, and
``op close`` ends the submission: idx that never came get a ``protocol_error`` row each, so the job
finishes, and ``finish_submission`` sets ``total`` (and finalises a job whose rows are all in).
Every op is idempotent, so one re-read after a crash (applied, not acked) changes nothing.

A request entry's checks against its job (no such job, idx out of range or taken already) are
``batchinfer.scheduler.entry_checks.refusal``, which the intake applies before it takes the entry in.

An op that cannot be applied is answered as a direct request: a ``protocol_error`` /
``invalid_request`` row in ``results:direct`` (and the op's ``reply_to``), plus a line in the job's
``errors`` when the job exists. An applied op with a ``reply_to`` is acknowledged there (only
there: it is no request of the job) by a ``completed`` row naming the op, the job's status after it
and its total (:func:`ack_row`), so that a producer can tell its ``close`` was applied.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Iterable, Iterator

import redis

from batchinfer.keys import Keys
from batchinfer.protocol.entries import JobOp, RequestError
from batchinfer.protocol.rows import ResultRow, fields_dict, now_ms, request_id_for
from batchinfer.scheduler.entry_checks import entry_ms, reply_stream, wrong_partition
from batchinfer.scheduler.lookups import JobCache, JobView, RowSink
from batchinfer.store import scripts
from batchinfer.store.jobcontrol import append_job_error, open_job
from batchinfer.store.jobstore import JobStore
from batchinfer.store.replies import Fields

log = logging.getLogger(__name__)

GAPS_NAMED = 10  # idx a close's job error names
GAP_CHUNK = 1000  # gap rows published (and their bits set) per round trip


def bit_ops(op: str, offsets: list[int]) -> list[str | int]:
    """BITFIELD arguments that ``GET`` (or ``SET`` to 1) the single bits at ``offsets``."""
    args: list[str | int] = []
    for offset in offsets:
        args += (op, "u1", offset, 1) if op == "SET" else (op, "u1", offset)
    return args


class JobOps:
    """Applies job control entries."""

    def __init__(self, r: redis.Redis, keys: Keys, jobs: JobCache, sink: RowSink):
        self.redis, self.keys, self.jobs, self.sink = r, keys, jobs, sink
        self.settings = sink.settings  # results root and output URI prefixes: what an open may name
        self.store = JobStore(r, keys)
        self._acknowledge = scripts.register(r, "acknowledge")

    def apply(self, entry_id: str, fields: Fields) -> None:
        """Apply one ``op`` entry (idempotent); a bad one is answered, never raised."""
        entry_id = self.keys.direct_id(entry_id)  # its answer's request id (with P > 1)
        try:
            op = JobOp.from_fields(fields)
        except RequestError as e:
            job = e.context.get("job")
            self._answer(entry_id, e.code, str(e), reply_stream(self.keys, e.context.get("reply_to")),
                         job if isinstance(job, str) else None)
            return
        if op.reply_to is not None and reply_stream(self.keys, op.reply_to) is None:
            self._answer(entry_id, "protocol_error", f"reply_to {op.reply_to!r} is not a reply stream: it "
                         f"must be a key under {self.keys.part(0).reply('')!r} (or another partition's reply "
                         f"namespace); op {op.op} was not applied",
                         None, op.job_id)
            return
        if (why := wrong_partition(self.keys, op.job_id)) is not None:
            self._answer(entry_id, "protocol_error", f"{why}; op {op.op} was not applied", op.reply_to,
                         op.job_id)
            return
        try:
            applied = {"open": self._open, "close": self._close, "cancel": self._cancel}[op.op](entry_id, op)
            if applied and op.reply_to is not None:
                self._ack(entry_id, op, op.reply_to)
        except (redis.ConnectionError, redis.TimeoutError):
            raise  # the pass is retried: every op is idempotent
        except Exception as e:  # one bad entry never stops the scheduler (nor comes back forever)
            log.exception("intake entry %s: op %s of job %s failed", entry_id, op.op, op.job_id)
            self._answer(entry_id, "internal_error", f"the scheduler failed on this op {op.op}: {e!r}",
                         op.reply_to, op.job_id)
        finally:
            self.jobs.forget(op.job_id)  # the entries after this op see the job as it left it

    def job_error(self, job_id: str, message: str) -> None:
        append_job_error(self.redis, self.keys, job_id, message)

    def _open(self, entry_id: str, op: JobOp) -> bool:
        # An existing record is left as it is: the Python client wrote it before sending this entry
        # (it may be in_progress or done by now), or this is a re-read after a crash. A producer that
        # reuses a closed job's id gets its entries refused (idx taken or out of range).
        try:
            created = open_job(self.redis, self.keys, op, self.settings)
        except RequestError as e:  # an output outside the operator's destinations: no job is opened
            self._answer(entry_id, e.code, str(e), op.reply_to, op.job_id)
            return False
        log.info("job %s: %s by intake entry %s", op.job_id, "opened" if created else "already open",
                 entry_id)
        return True

    def _close(self, entry_id: str, op: JobOp) -> bool:
        total = int(op.params["total"])
        view = self._view(op.job_id)
        if not view.exists:
            self._answer(entry_id, "protocol_error", f"job {op.job_id!r} does not exist: op close was "
                         "ignored (open the job first with an 'op open' entry)", op.reply_to)
            return False
        if view.total is not None and view.total != total:
            self._answer(entry_id, "protocol_error", f"job {op.job_id!r} was already closed with total "
                         f"{view.total}: op close with total {total} was ignored", op.reply_to, op.job_id)
            return False
        final = self._fill_gaps(op.job_id, total)
        self.sink.finish_submission(op.job_id, final)
        log.info("job %s: closed with total %d by intake entry %s", op.job_id, final, entry_id)
        return True

    def _cancel(self, entry_id: str, op: JobOp) -> bool:
        if self.store.cancel(op.job_id) is None:
            self._answer(entry_id, "protocol_error",
                         f"job {op.job_id!r} does not exist: op cancel was ignored", op.reply_to)
            return False
        return True

    def _ack(self, entry_id: str, op: JobOp, reply_to: str) -> None:
        """Acknowledge applied op ``entry_id`` on its ``reply_to`` (a stream or no key yet; a key of
        another type is left alone and counted, as a row's ``reply_to`` is)."""
        row = ack_row(entry_id, op, self._view(op.job_id))
        ttl = self.sink.publisher.direct_guard_ttl  # a reply stream's life after its last row
        if not self._acknowledge(keys=[reply_to], args=[row, ttl]):
            log.warning("intake entry %s (op %s): reply_to %s is not a stream: no acknowledgement written",
                        entry_id, op.op, op.reply_to)
            if self.sink.metrics is not None:
                self.sink.metrics.reply_skipped()

    def _view(self, job_id: str) -> JobView:
        self.jobs.forget(job_id)
        return self.jobs.get(job_id)

    def _fill_gaps(self, job_id: str, total: int) -> int:
        """The job's total once closed: ``total``, or more when entries past it were taken in already.

        Every idx below it that has neither an entry taken in nor a row (the Python client answers
        lines it cannot send itself) gets a ``protocol_error`` row, so the job can finish; its bit is
        set, so a late entry for it is refused rather than run.
        """
        pipe = self.redis.pipeline(transaction=False)
        pipe.get(self.keys.admitted(job_id))
        pipe.get(self.keys.published(job_id))
        admitted, published = (bytes(v or b"") for v in pipe.execute())
        final = max(total, _highest_bit(admitted) + 1)
        if final != total:
            self.job_error(job_id, f"op close said total {total}, but entries up to idx {final - 1} were "
                           f"taken in before it: the job's total is {final}")
        # Gaps are answered a chunk at a time: memory stays flat however many there are.
        count, now = 0, now_ms()
        named: list[int] = []
        for chunk in _chunks(_unset_bits(_or(admitted, published), final), GAP_CHUNK):
            rows = []
            for i in chunk:
                row = ResultRow.error("protocol_error", f"no entry with idx {i} was taken in before job "
                                      f"{job_id!r} was closed with total {final}", job_id=job_id, idx=i,
                                      request_id=request_id_for(job_id, i), created_at=now)
                row.finished_at = now
                rows.append((row, None))
            self.sink.publish_many(rows)
            self.redis.execute_command("BITFIELD", self.keys.admitted(job_id), *bit_ops("SET", chunk))
            count += len(chunk)
            named += chunk[:GAPS_NAMED - len(named)]
        if count:
            listed = ", ".join(map(str, named)) + (", ..." if count > GAPS_NAMED else "")
            self.job_error(job_id, f"op close with total {final}: {count} idx had no entry ({listed}); "
                           "each got a protocol_error row")
        return final

    def _answer(self, entry_id: str, code: str, message: str, reply_to: str | None,
                job_id: str | None = None) -> None:
        """An op that cannot be applied: a direct row (``results:direct`` and ``reply_to``), a job error."""
        log.warning("intake entry %s (op): %s", entry_id, message)
        row = ResultRow.error(code, message, job_id=None, request_id=entry_id, created_at=entry_ms(entry_id))
        self.sink.publish(row, reply_to)
        if job_id:
            self.job_error(job_id, f"entry {entry_id}: {message}")


def ack_row(entry_id: str, op: JobOp, view: JobView) -> str:
    """The JSON acknowledgement of applied op ``entry_id``: a ``completed`` result row whose
    ``request_id`` is the op's entry id (``idx`` null: no request of the job), plus ``op``, the job's
    ``job_status`` after the op and its ``job_total`` (null until closed)."""
    row = ResultRow(job_id=op.job_id, request_id=entry_id, status="completed", model=view.model,
                    created_at=entry_ms(entry_id), finished_at=now_ms())
    status = view.status.value if view.status is not None else None
    return json.dumps({**fields_dict(row), "op": op.op, "job_status": status, "job_total": view.total},
                      ensure_ascii=False, separators=(",", ":"))


def _highest_bit(bitmap: bytes) -> int:
    """The highest index set in a Redis bitmap (bit 0 = the first byte's most significant bit), or -1."""
    trimmed = bitmap.rstrip(b"\0")
    if not trimmed:
        return -1
    last = trimmed[-1]
    return (len(trimmed) - 1) * 8 + 7 - ((last & -last).bit_length() - 1)


def _or(a: bytes, b: bytes) -> bytes:
    n = max(len(a), len(b))
    if not n:
        return b""
    merged = int.from_bytes(a.ljust(n, b"\0"), "big") | int.from_bytes(b.ljust(n, b"\0"), "big")
    return merged.to_bytes(n, "big")


def _unset_bits(bitmap: bytes, total: int) -> Iterator[int]:
    """Indexes ``0 .. total-1`` whose bit is not set, in order (fast when every byte is full)."""
    bitmap = bitmap.ljust((total + 7) // 8, b"\0")
    full = total // 8
    start = full if bitmap[:full].count(0xFF) == full else 0  # the usual case: only the tail to look at
    for byte_i in range(start, (total + 7) // 8):
        byte = bitmap[byte_i]
        if byte == 0xFF:
            continue
        for bit in range(8):
            i = byte_i * 8 + bit
            if i < total and not byte & (0x80 >> bit):
                yield i


def _chunks(items: Iterable[int], size: int) -> Iterator[list[int]]:
    it = iter(items)
    while chunk := list(itertools.islice(it, size)):
        yield chunk
