"""OpenAI's Files API: ``/v1/files`` (upload, list), ``/v1/files/{file_id}`` (retrieve, delete) and
``/v1/files/{file_id}/content`` (download, streamed).

An upload is parsed as it arrives (python-multipart's streaming parser over ``request.stream()``)
and its bytes go to the file store a megabyte at a time: a file is never held whole in memory, and
one over the key's size limit is refused 413 with its partial bytes deleted. Another key's file
reads as no file (404), never its name or its bytes.
"""

from __future__ import annotations

from typing import Any

from python_multipart import MultipartParser
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import parse_options_header
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from batchinfer.api.app import context
from batchinfer.api.auth import authenticate
from batchinfer.api.errors import ApiError
from batchinfer.store.filestore import UPLOAD_PURPOSES, FileObject, FileTooLarge, Upload

MAX_LIST_LIMIT = 10_000  # OpenAI's (and its default)
MAX_FIELD_BYTES = 64 * 1024  # a form field that is not the file (purpose, expires_after[...])
MULTIPART_SLACK = 1 << 20  # body bytes allowed beyond the file limit: part headers and other fields
WRITE_BYTES = 1 << 20  # file bytes gathered before one write to the store
EXPIRY_RANGE = (3600, 30 * 24 * 3600)  # OpenAI's bounds of expires_after[seconds]


def not_found(file_id: str) -> ApiError:
    return ApiError(404, f"No such File object: {file_id}", param="file_id")


class _Form:
    """python-multipart's callbacks gathered into events, acted on once each chunk is parsed:
    ``("field", name, value)``, ``("file", name, filename)`` at a file part's start, ``("data",
    bytes)`` (its bytes) and ``("end",)`` at its end."""

    def __init__(self, boundary: bytes):
        self.events: list[tuple[Any, ...]] = []
        self.ended = False
        self._header, self._value = b"", b""
        self._disposition = b""
        self._field: bytearray | None = None  # the value of the field part being read
        self._name = ""
        self.parser = MultipartParser(boundary, {
            "on_part_begin": self._part_begin, "on_part_data": self._part_data, "on_part_end": self._part_end,
            "on_header_field": self._header_field, "on_header_value": self._header_value,
            "on_header_end": self._header_end, "on_headers_finished": self._headers_finished,
            "on_end": self._end})

    def feed(self, chunk: bytes) -> list[tuple[Any, ...]]:
        """Parse ``chunk``; the events it completed (file bytes of one chunk come as one event)."""
        self.parser.write(chunk)
        events, self.events = self.events, []
        return events

    def _part_begin(self) -> None:
        self._disposition, self._field = b"", None

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._header += data[start:end]

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]

    def _header_end(self) -> None:
        if self._header.lower() == b"content-disposition":
            self._disposition = self._value
        self._header, self._value = b"", b""

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self._disposition)
        self._name = options.get(b"name", b"").decode("utf-8", "replace")
        if b"filename" in options:
            self.events.append(("file", self._name, options[b"filename"].decode("utf-8", "replace")))
        else:
            self._field = bytearray()

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._field is None:
            if self.events and self.events[-1][0] == "data":
                self.events[-1] = ("data", self.events[-1][1] + data[start:end])
            else:
                self.events.append(("data", data[start:end]))
            return
        self._field += data[start:end]
        if len(self._field) > MAX_FIELD_BYTES:
            raise ApiError(400, f"The form field {self._name!r} is longer than {MAX_FIELD_BYTES} bytes.",
                           param=self._name)

    def _part_end(self) -> None:
        if self._field is None:
            self.events.append(("end",))
        else:
            self.events.append(("field", self._name, self._field.decode("utf-8", "replace")))

    def _end(self) -> None:
        self.ended = True


class _Receiver:
    """One upload's state while its body streams in: the form's fields, the store's upload, and the
    file bytes not written yet."""

    def __init__(self, request: Request, owner: str, max_bytes: int):
        self.request, self.owner, self.max_bytes = request, owner, max_bytes
        self.fields: dict[str, str] = {}
        self.upload: Upload | None = None
        self.file_ended = False
        self.pending = bytearray()

    async def event(self, event: tuple[Any, ...]) -> None:
        kind = event[0]
        if kind == "field":
            self.fields[event[1]] = event[2]
        elif kind == "file":
            await self.begin(event[1], event[2])
        elif kind == "data":
            self.pending += event[1]
            if len(self.pending) >= WRITE_BYTES:
                await self.flush()
        elif kind == "end" and self.upload is not None and not self.file_ended:
            self.file_ended = True
            await self.flush()

    async def begin(self, name: str, filename: str) -> None:
        if name != "file":
            raise ApiError(400, f"Unexpected file field {name!r}: send the file as the field 'file'.",
                           param=name)
        if self.upload is not None:
            raise ApiError(400, "Send one file per upload (the field 'file' came twice).", param="file")
        if not filename:
            raise ApiError(400, "The file has no filename: send it with one.", param="file")
        # the purpose may come after the file (form order is the client's): checked again at the end
        purpose = self.fields.get("purpose", UPLOAD_PURPOSES[0])
        _check_purpose(purpose)
        store = context(self.request).files
        expiry = _expiry(self.fields)
        try:
            self.upload = await run_in_threadpool(store.upload, self.owner, filename, purpose,
                                                  max_bytes=self.max_bytes, expires_after_s=expiry)
        except ValueError as e:
            raise ApiError(400, str(e), param="file") from None

    async def flush(self) -> None:
        if self.pending and self.upload is not None:
            data, self.pending = bytes(self.pending), bytearray()
            try:
                await run_in_threadpool(self.upload.write, data)
            except FileTooLarge as e:
                raise _too_large(e.limit) from None

    async def commit(self) -> FileObject:
        if self.upload is None:
            raise ApiError(400, "Missing required parameter: 'file' (a multipart file field).", param="file")
        if "purpose" not in self.fields:
            raise ApiError(400, "Missing required parameter: 'purpose'.", param="purpose")
        if not self.file_ended:
            raise ApiError(400, "The multipart body ended before the file did.", param="file")
        _check_purpose(self.fields["purpose"])
        self.upload.purpose, self.upload.expires_after_s = self.fields["purpose"], _expiry(self.fields)
        return await run_in_threadpool(self.upload.commit)

    async def abort(self) -> None:
        if self.upload is not None:
            await run_in_threadpool(self.upload.abort)


def _check_purpose(purpose: str) -> None:
    if purpose not in UPLOAD_PURPOSES:
        raise ApiError(400, f"Invalid purpose {purpose!r}: this server takes "
                            f"{' or '.join(repr(p) for p in UPLOAD_PURPOSES)}.", param="purpose")


def _expiry(fields: dict[str, str]) -> int | None:
    """``expires_after[anchor]`` / ``expires_after[seconds]`` (OpenAI's): the seconds, or None."""
    anchor, seconds = fields.get("expires_after[anchor]"), fields.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        raise ApiError(400, f"expires_after[anchor] must be 'created_at', got {anchor!r}.",
                       param="expires_after.anchor")
    low, high = EXPIRY_RANGE
    if seconds is None or not seconds.strip().isdigit() or not low <= int(seconds) <= high:
        raise ApiError(400, f"expires_after[seconds] must be a whole number from {low} to {high}, got "
                            f"{seconds!r}.", param="expires_after.seconds")
    return int(seconds)


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"The file is larger than this key's limit of {limit} bytes.", code="file_too_large",
                    param="file")


async def create_file(request: Request) -> Response:
    """``POST /v1/files``: multipart ``purpose``, ``file``, optional ``expires_after[anchor|seconds]``."""
    ctx = context(request)
    key = await run_in_threadpool(authenticate, request)
    max_files = key.limit("max_files", ctx.settings)
    if await run_in_threadpool(ctx.files.count, key.id) >= max_files:
        raise ApiError(429, f"This key holds {max_files} files, its limit: delete some first.",
                       code="files_limit_exceeded")
    max_bytes = key.limit("max_file_bytes", ctx.settings)
    ctype, options = parse_options_header(request.headers.get("content-type", ""))
    if ctype != b"multipart/form-data" or not options.get(b"boundary"):
        raise ApiError(400, "Upload a file as multipart/form-data (fields 'purpose' and 'file').")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes + MULTIPART_SLACK:
        raise _too_large(max_bytes)
    try:
        form = _Form(options[b"boundary"])
    except FormParserError as e:  # a boundary python-multipart refuses (too long)
        raise ApiError(400, f"The multipart boundary is invalid: {e}") from None
    receiver = _Receiver(request, key.id, max_bytes)
    refusal: ApiError | None = None
    drained = 0
    try:
        async for chunk in request.stream():
            if refusal is not None:  # read the rest (bounded), so the client gets to see the answer
                drained += len(chunk)
                if drained > max_bytes + MULTIPART_SLACK:
                    break
                continue
            try:
                for event in form.feed(chunk):
                    await receiver.event(event)
            except FormParserError as e:
                refusal = ApiError(400, f"The multipart body is malformed: {e}")
            except ApiError as e:
                refusal = e
            if refusal is not None:
                await receiver.abort()
        if refusal is not None:
            raise refusal
        if not form.ended:
            raise ApiError(400, "The multipart body ended before its closing boundary.")
        f = await receiver.commit()
    except BaseException:  # a refusal, a client gone (ClientDisconnect), a store error: no file
        await receiver.abort()
        raise
    return JSONResponse(f.to_openai())


def _int_param(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if not raw.strip().lstrip("-").isdigit() or not low <= int(raw) <= high:
        raise ApiError(400, f"{name} must be a whole number from {low} to {high}, got {raw!r}.", param=name)
    return int(raw)


def list_files(request: Request) -> Response:
    """``GET /v1/files``: ``purpose``, ``limit`` (1 to 10,000; 10,000), ``after`` (a file id),
    ``order`` (``desc`` newest first, the default, or ``asc``)."""
    ctx = context(request)
    key = authenticate(request)
    q = request.query_params
    limit = _int_param(request, "limit", MAX_LIST_LIMIT, 1, MAX_LIST_LIMIT)
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ApiError(400, f"order must be 'asc' or 'desc', got {order!r}.", param="order")
    page, more = ctx.files.list(key.id, purpose=q.get("purpose") or None, limit=limit,
                                after=q.get("after") or None, order=order)
    return JSONResponse(list_body([f.to_openai() for f in page], more))


def list_body(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """OpenAI's list object."""
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


def _own_file(request: Request) -> FileObject:
    ctx = context(request)
    key = authenticate(request)
    file_id = request.path_params["file_id"]
    f = ctx.files.get(file_id, key.id)
    if f is None:
        raise not_found(file_id)
    return f


def retrieve_file(request: Request) -> Response:
    """``GET /v1/files/{file_id}``: the File object."""
    return JSONResponse(_own_file(request).to_openai())


def file_content(request: Request) -> Response:
    """``GET /v1/files/{file_id}/content``: the bytes, streamed from the store."""
    f = _own_file(request)
    chunks = context(request).files.read(f)
    headers = {"content-disposition": f'attachment; filename="{_quoted(f.filename)}"'}
    if f.bytes is not None:
        headers["content-length"] = str(f.bytes)
    return StreamingResponse(chunks, media_type="application/octet-stream", headers=headers)


def _quoted(filename: str) -> str:
    """A filename safe inside a quoted header parameter (latin-1, no quotes or backslashes)."""
    safe = filename.encode("latin-1", "replace").decode("latin-1")
    return "".join("_" if c in '"\\\r\n' else c for c in safe)


def delete_file(request: Request) -> Response:
    """``DELETE /v1/files/{file_id}``: the bytes, then the record."""
    ctx = context(request)
    key = authenticate(request)
    file_id = request.path_params["file_id"]
    if not ctx.files.delete(file_id, key.id):
        raise not_found(file_id)
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})


ROUTES = [
    Route("/v1/files", create_file, methods=["POST"]),
    Route("/v1/files", list_files, methods=["GET"]),
    Route("/v1/files/{file_id}", retrieve_file, methods=["GET"]),
    Route("/v1/files/{file_id}", delete_file, methods=["DELETE"]),
    Route("/v1/files/{file_id}/content", file_content, methods=["GET"]),
]
