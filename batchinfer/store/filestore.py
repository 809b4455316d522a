"""The HTTP API's file store: uploaded files and batch result files, bytes in a filesystem, records in Redis.

The bytes live under one root (``Settings.files_root()``): a local folder or an object store URI
(``s3://bucket/prefix``), both through ``pyarrow.fs``, the layer the exporter writes result files
with, so the API serves the very bytes the exporter wrote. A file is ``<root>/<file id>``; its record
``{p}:file:<id>`` (owner, name, purpose, size, times) and its place in the owner's listing
``{p}:files:<owner>`` are written only once the bytes are complete and in place. So a process
killed mid-upload leaves no visible file: on a local disk a hidden temporary name
(``.<id>.<random>.tmp``, removed by :meth:`FileStore.sweep_expired` once stale), on an object store
an unfinished multipart upload, never an object (the object store's lifecycle rule reclaims its parts).

Files expire ``files_retention_seconds`` after their creation (an upload may ask for less): expired
files read as gone at once, and :meth:`FileStore.sweep_expired` deletes their bytes and records.
"""

from __future__ import annotations

import contextlib
import io
import re
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, cast

import pyarrow.fs as pafs
import redis

from batchinfer.clock import WALL_MS, WallClock
from batchinfer.config import Settings
from batchinfer.keys import Keys
from batchinfer.redis_conn import as_text
from batchinfer.store import scripts

if TYPE_CHECKING:
    from redis.typing import EncodableT, FieldT

UPLOAD_PURPOSES = ("batch", "user_data")
OUTPUT_PURPOSE = "batch_output"
MAX_FILENAME_CHARS = 1024
STALE_TEMP_SECONDS = 24 * 3600  # a local temporary upload older than this belonged to a dead process
_ID = re.compile(r"file-[0-9a-f]{24}")
_SWEEP_BATCH = 500


def valid_file_id(file_id: object) -> bool:
    """Whether ``file_id`` has the shape of this store's ids (``file-`` + 24 hex digits)."""
    return isinstance(file_id, str) and _ID.fullmatch(file_id) is not None


@dataclass
class FileObject:
    """A stored file as the API shows it. Times are unix seconds; ``bytes`` is None until written."""

    id: str
    owner: str  # the API key id
    filename: str
    purpose: str
    bytes: int | None
    created_at: int
    expires_at: int | None
    location: str  # the URI of its bytes
    ready: bool  # False: an export's output not written yet

    def to_openai(self) -> dict[str, Any]:
        """The object ``openai.types.FileObject`` parses."""
        return {"id": self.id, "object": "file", "bytes": self.bytes or 0, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed",
                "expires_at": self.expires_at, "status_details": None}


class FileTooLarge(ValueError):
    """An upload went past its byte limit (``limit``)."""

    def __init__(self, limit: int):
        super().__init__(f"the file is larger than the limit of {limit} bytes")
        self.limit = limit


def _record(f: FileObject) -> dict[FieldT, EncodableT]:
    return {"owner": f.owner, "filename": f.filename, "purpose": f.purpose,
            "bytes": "" if f.bytes is None else f.bytes, "created_at": f.created_at,
            "expires_at": "" if f.expires_at is None else f.expires_at, "location": f.location,
            "ready": int(f.ready)}


def _parse(file_id: str, raw: dict) -> FileObject | None:
    if not raw:
        return None
    h = {as_text(k): as_text(v) for k, v in raw.items()}
    return FileObject(id=file_id, owner=h["owner"], filename=h["filename"], purpose=h["purpose"],
                      bytes=int(h["bytes"]) if h.get("bytes") else None, created_at=int(h["created_at"]),
                      expires_at=int(h["expires_at"]) if h.get("expires_at") else None,
                      location=h["location"], ready=h.get("ready") == "1")


class FileStore:
    """Files under ``settings.files_root()``, records in Redis. Safe to share between threads."""

    def __init__(self, redis_client: redis.Redis, keys: Keys, settings: Settings, *,
                 clock: WallClock = WALL_MS):
        self.redis = redis_client
        self.keys = keys
        self.root = settings.files_root()
        self.retention_s = settings.files_retention_seconds
        self._clock = clock
        self._page = scripts.register(redis_client, "zset_page")

    @cached_property
    def _fs_base(self) -> tuple[pafs.FileSystem, str]:
        # on first use, not at construction: an object store's client may look its bucket up
        fs, base = pafs.FileSystem.from_uri(self.root)
        return fs, base.rstrip("/")

    @property
    def fs(self) -> pafs.FileSystem:
        """The filesystem the bytes live on."""
        return self._fs_base[0]

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, pafs.LocalFileSystem)

    def path(self, file_id: str) -> str:
        """The file's path on :attr:`fs`."""
        return f"{self._fs_base[1]}/{file_id}"

    @staticmethod
    def new_id() -> str:
        """A fresh file id: ``file-`` + 24 random hex digits."""
        return "file-" + secrets.token_hex(12)

    def location(self, file_id: str) -> str:
        """The URI of a file's bytes: ``<root>/<file id>`` (where an export writes a result file)."""
        if not valid_file_id(file_id):
            raise ValueError(f"not a file id: {file_id!r}")
        return f"{self.root}/{file_id}"

    def _now_s(self) -> int:
        return self._clock() // 1000

    def _expiry(self, created_s: int, asked_s: int | None) -> int | None:
        if asked_s is not None and (not isinstance(asked_s, int) or asked_s <= 0):
            raise ValueError(f"expires_after must be a positive number of seconds, got {asked_s!r}")
        limits = [s for s in (self.retention_s or None, asked_s) if s is not None]
        return created_s + min(limits) if limits else None

    # -- writing -------------------------------------------------------------------------------

    def upload(self, owner: str, filename: str, purpose: str, *, max_bytes: int,
               expires_after_s: int | None = None) -> Upload:
        """Start an upload (a context manager): ``write`` its bytes, then ``commit``.

        ``expires_after_s``: the client's own expiry (OpenAI's ``expires_after``), capped at the
        retention. ValueError for a purpose not in :data:`UPLOAD_PURPOSES` or a bad filename.
        """
        if purpose not in UPLOAD_PURPOSES:
            raise ValueError(f"purpose must be one of {', '.join(UPLOAD_PURPOSES)}, got {purpose!r}")
        if not isinstance(filename, str) or not filename or len(filename) > MAX_FILENAME_CHARS:
            raise ValueError(f"filename must be 1 to {MAX_FILENAME_CHARS} characters")
        self._expiry(0, expires_after_s)  # checked now, not at commit
        return Upload(self, self.new_id(), owner, filename, purpose, max_bytes, expires_after_s)

    def _record_new(self, f: FileObject, created_ms: int) -> None:
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(self.keys.file(f.id), mapping=_record(f))
        pipe.zadd(self.keys.files(f.owner), {f.id: created_ms})
        if f.expires_at is not None:
            pipe.zadd(self.keys.files_expiring, {f.id: f.expires_at})
        pipe.execute()

    def add_output(self, file_id: str, owner: str, filename: str,
                   purpose: str = OUTPUT_PURPOSE) -> FileObject:
        """Record a file an export writes later at :meth:`location` (``ready`` False until its bytes
        are there). Recording the same id for the same owner again returns the first record."""
        old = _parse(file_id, self.redis.hgetall(self.keys.file(self._checked(file_id))))
        if old is not None:
            if old.owner != owner:
                raise ValueError(f"file {file_id} already belongs to another key")
            return old
        now_ms = self._clock()
        f = FileObject(id=file_id, owner=owner, filename=filename, purpose=purpose, bytes=None,
                       created_at=now_ms // 1000, expires_at=self._expiry(now_ms // 1000, None),
                       location=self.location(file_id), ready=False)
        self._record_new(f, now_ms)
        return f

    @staticmethod
    def _checked(file_id: str) -> str:
        if not valid_file_id(file_id):
            raise ValueError(f"not a file id: {file_id!r}")
        return file_id

    # -- reading -------------------------------------------------------------------------------

    def _visible(self, f: FileObject | None, owner: str, now_s: int) -> FileObject | None:
        """``f`` as its owner sees it now: None when another's, expired, or an output not yet written."""
        if f is None or f.owner != owner or (f.expires_at is not None and f.expires_at <= now_s):
            return None
        return f if f.ready else self._refresh(f)

    def _refresh(self, f: FileObject) -> FileObject | None:
        """An output's record once its bytes are there (recorded as ready with their size), else None."""
        info = self.fs.get_file_info(self.path(f.id))
        if info.type != pafs.FileType.File:
            return None
        f.ready, f.bytes = True, info.size
        key = self.keys.file(f.id)
        with contextlib.suppress(redis.WatchError), self.redis.pipeline(transaction=True) as pipe:
            pipe.watch(key)
            if pipe.exists(key):  # never recreate a record deleted meanwhile
                pipe.multi()
                pipe.hset(key, mapping={"ready": 1, "bytes": f.bytes})
                pipe.execute()
        return f

    def get(self, file_id: str, owner: str) -> FileObject | None:
        """The file, if ``owner`` may see it: None when there is none, it is another key's, it has
        expired, or it is an output whose bytes are not written yet."""
        if not valid_file_id(file_id):
            return None
        f = _parse(file_id, self.redis.hgetall(self.keys.file(file_id)))
        return self._visible(f, owner, self._now_s())

    def list(self, owner: str, *, purpose: str | None = None, limit: int = 10000, after: str | None = None,
             order: str = "desc") -> tuple[list[FileObject], bool]:
        """A page of ``owner``'s files (ready ones only), newest first (``order="desc"``) or oldest
        first, after the file ``after`` (a cursor: an id of an earlier page); ``(files, has_more)``."""
        if order not in ("asc", "desc"):
            raise ValueError(f"order must be 'asc' or 'desc', got {order!r}")
        if not isinstance(limit, int) or limit < 1:
            raise ValueError(f"limit must be a positive integer, got {limit!r}")
        key = self.keys.files(owner)
        cursor: tuple[str, str] | None = None
        if after is not None:
            score = self.redis.zscore(key, after)
            if score is None:
                return [], False  # not a file of this owner (or deleted): nothing comes after it
            cursor = (repr(int(score)), after)
        found: list[FileObject] = []
        chunk = min(max(limit + 1, 64), 1000)
        now_s = self._now_s()
        while len(found) <= limit:
            flat = self._page(keys=[key], args=[order, chunk, *(cursor or ())])
            ids = [as_text(m) for m in flat[0::2]]
            if not ids:
                break
            pipe = self.redis.pipeline(transaction=False)
            for file_id in ids:
                pipe.hgetall(self.keys.file(file_id))
            for file_id, raw in zip(ids, pipe.execute(), strict=True):
                f = _parse(file_id, raw)
                if f is not None and (purpose is None or f.purpose == purpose):
                    shown = self._visible(f, owner, now_s)
                    if shown is not None:
                        found.append(shown)
            cursor = (as_text(flat[-1]), ids[-1])
            if len(ids) < chunk:
                break
        return found[:limit], len(found) > limit

    def count(self, owner: str) -> int:
        """How many files ``owner`` holds (uploads and outputs, until deleted or swept)."""
        return int(self.redis.zcard(self.keys.files(owner)))

    def read(self, f: FileObject, chunk_bytes: int = 1 << 20) -> Iterator[bytes]:
        """The file's bytes, ``chunk_bytes`` at a time (the file is opened at the first ``next``)."""
        with self.fs.open_input_stream(self.path(f.id)) as stream:
            while chunk := stream.read(chunk_bytes):
                yield chunk

    def lines(self, f: FileObject) -> Iterator[bytes]:
        """The file's lines without their ``b"\\n"`` (a last line without one included), streamed."""
        with self.fs.open_input_stream(self.path(f.id)) as stream:
            reader = io.BufferedReader(cast(io.RawIOBase, stream), buffer_size=1 << 20)
            for line in reader:
                yield line[:-1] if line.endswith(b"\n") else line

    # -- deleting ------------------------------------------------------------------------------

    def delete(self, file_id: str, owner: str) -> bool:
        """Delete ``owner``'s file: its bytes first, then its record and index entries. False (and
        nothing done) when ``owner`` cannot see it; an expired one is deleted, but reads as gone."""
        if not valid_file_id(file_id):
            return False
        f = _parse(file_id, self.redis.hgetall(self.keys.file(file_id)))
        if f is None or f.owner != owner:
            return False
        expired = f.expires_at is not None and f.expires_at <= self._now_s()
        if not expired and not f.ready and self._refresh(f) is None:
            return False  # an output not written yet: the export still owns its place
        self._delete(f.id, f.owner)
        return not expired

    def delete_bytes(self, file_id: str) -> None:
        """Delete the bytes at ``file_id``'s place, if any (a file with no record too: an Anthropic
        batch's results)."""
        with contextlib.suppress(FileNotFoundError):
            self.fs.delete_file(self.path(file_id))

    def _delete(self, file_id: str, owner: str | None) -> None:
        self.delete_bytes(file_id)
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(self.keys.file(file_id))
        if owner is not None:
            pipe.zrem(self.keys.files(owner), file_id)
        pipe.zrem(self.keys.files_expiring, file_id)
        pipe.execute()

    def sweep_expired(self, now_s: int | None = None) -> int:
        """Delete every file expired at ``now_s`` (default now), bytes then records; how many.

        On a local disk, also removes temporary uploads older than :data:`STALE_TEMP_SECONDS`
        (left by processes killed mid-upload).
        """
        now_s = self._now_s() if now_s is None else now_s
        swept = 0
        while ids := [as_text(m) for m in cast(list, self.redis.zrangebyscore(
                self.keys.files_expiring, "-inf", now_s, start=0, num=_SWEEP_BATCH))]:
            pipe = self.redis.pipeline(transaction=False)
            for file_id in ids:
                pipe.hget(self.keys.file(file_id), "owner")
            for file_id, owner in zip(ids, pipe.execute(), strict=True):
                self._delete(file_id, None if owner is None else as_text(owner))
                swept += 1
        if self.is_local:
            self._sweep_temporaries(now_s)
        return swept

    def _sweep_temporaries(self, now_s: int) -> None:
        selector = pafs.FileSelector(self._fs_base[1], allow_not_found=True)
        for info in self.fs.get_file_info(selector):
            if (info.base_name.startswith(".file-") and info.base_name.endswith(".tmp")
                    and info.type == pafs.FileType.File and info.mtime_ns is not None
                    and info.mtime_ns // 10**9 < now_s - STALE_TEMP_SECONDS):
                with contextlib.suppress(FileNotFoundError):
                    self.fs.delete_file(info.path)


class Upload:
    """One file being uploaded: :meth:`write` its bytes, then :meth:`commit` (or :meth:`abort`).

    As a context manager it aborts on leaving without a commit. Bytes go to a hidden temporary name
    moved into place on commit (local disks), or straight to the final key of an object store, where
    an object exists only once its output stream closes. The record is written after the bytes are
    in place, so no reader ever sees a part of a file.
    """

    def __init__(self, store: FileStore, file_id: str, owner: str, filename: str, purpose: str,
                 max_bytes: int, expires_after_s: int | None):
        self.store, self.id, self.owner = store, file_id, owner
        self.filename, self.purpose, self.max_bytes = filename, purpose, max_bytes
        self.expires_after_s = expires_after_s
        self.size = 0
        self._done = False
        fs, self._final = store.fs, store.path(file_id)
        self._write_to = self._final
        if store.is_local:
            parent = self._final.rsplit("/", 1)[0]
            fs.create_dir(parent, recursive=True)
            self._write_to = f"{parent}/.{file_id}.{secrets.token_hex(6)}.tmp"
        self._stream = fs.open_output_stream(self._write_to)

    def write(self, data: bytes) -> None:
        """Append ``data``; :class:`FileTooLarge` (the upload aborted) past ``max_bytes``."""
        if self._done:
            raise ValueError(f"upload {self.id} is already finished")
        if self.size + len(data) > self.max_bytes:
            self.abort()
            raise FileTooLarge(self.max_bytes)
        self._stream.write(data)
        self.size += len(data)

    def commit(self) -> FileObject:
        """Place the bytes, then record the file; the :class:`FileObject` now visible to its owner."""
        if self._done:
            raise ValueError(f"upload {self.id} is already finished")
        try:
            self._stream.close()  # on an object store: the object appears now, whole
            if self._write_to != self._final:
                self.store.fs.move(self._write_to, self._final)  # rename(2): atomic
            now_ms = self.store._clock()
            now = now_ms // 1000
            expires_at = self.store._expiry(now, self.expires_after_s)
            f = FileObject(id=self.id, owner=self.owner, filename=self.filename, purpose=self.purpose,
                           bytes=self.size, created_at=now, expires_at=expires_at,
                           location=self.store.location(self.id), ready=True)
            self.store._record_new(f, now_ms)
        except BaseException:
            self.abort()
            raise
        self._done = True
        return f

    def abort(self) -> None:
        """Drop the upload and any bytes written (idempotent; nothing after a commit)."""
        if self._done:
            return
        self._done = True
        # pyarrow cannot abandon an object store's upload: closing completes it, so delete it after
        with contextlib.suppress(Exception):
            self._stream.close()
        with contextlib.suppress(Exception):
            self.store.fs.delete_file(self._write_to)

    def __enter__(self) -> Upload:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()

    def __del__(self) -> None:
        # dropped unfinished (a handler's task cancelled): pyarrow's stream would close itself and,
        # on an object store, publish the partial object; abort deletes it instead
        if not getattr(self, "_done", True):
            self.abort()
