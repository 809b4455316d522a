"""The file store (batchinfer/store/filestore.py) on a real Redis, each test on a local folder and on a
real S3-compatible server (moto's, tests/s3_server.py): uploads, reads, owners, pagination, retention,
outputs written by the exporter's own writer, and no half file ever visible."""

from __future__ import annotations

import signal
import subprocess
import sys
import uuid

import pyarrow.fs as pafs
import pytest

from batchinfer.config import Settings
from batchinfer.jobs.output import atomic_output, resolve
from batchinfer.keys import Keys
from batchinfer.protocol.destinations import check_output
from batchinfer.store.filestore import FileObject, FileStore, FileTooLarge

T0 = 1_700_000_000_000
ALICE, BOB = "key_aaaaaaaaaaaa", "key_bbbbbbbbbbbb"


class Clock:
    """A wall clock (ms) the test sets; ``tick`` ms pass per reading so creation order is defined."""

    def __init__(self, ms: int = T0, tick: int = 0):
        self.ms, self.tick = ms, tick

    def __call__(self) -> int:
        self.ms += self.tick
        return self.ms


@pytest.fixture(params=["local", "s3"])
def files_dir(request, tmp_path, monkeypatch) -> str:
    """The store's root: a local folder, or a fresh bucket's prefix on the moto server."""
    if request.param == "local":
        return str(tmp_path / "files")
    s3 = request.getfixturevalue("s3_server")
    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    return s3.make_bucket(f"files-{uuid.uuid4().hex[:12]}") + "/store"


@pytest.fixture
def settings(files_dir, tmp_path) -> Settings:
    return Settings(results_root=str(tmp_path / "results"), files_dir=files_dir, files_retention_seconds=3600)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(redis_server, settings, clock) -> FileStore:
    return FileStore(redis_server.client(), Keys("{t}"), settings, clock=clock)


def _upload(store: FileStore, data: bytes, owner: str = ALICE, purpose: str = "batch", **kw) -> FileObject:
    with store.upload(owner, "in.jsonl", purpose, max_bytes=kw.pop("max_bytes", 1 << 30), **kw) as up:
        step = max(7, len(data) // 8)  # several writes, small ones for small files
        for i in range(0, len(data), step):
            up.write(data[i:i + step])
        return up.commit()


def _visible_names(store: FileStore) -> list[str]:
    """Names under the root a reader would take for files (hidden temporary names left out)."""
    infos = store.fs.get_file_info(pafs.FileSelector(store.path("x").rsplit("/", 1)[0], allow_not_found=True))
    return [i.base_name for i in infos if not i.base_name.startswith(".")]


def test_an_upload_reads_back_whole_and_as_openai_shows_files(store, clock):
    data = b'{"custom_id": "a"}\n{"custom_id": "b"}\n'
    f = _upload(store, data)
    assert f.id.startswith("file-") and len(f.id) == 5 + 24
    assert (f.owner, f.filename, f.purpose, f.bytes, f.ready) == (ALICE, "in.jsonl", "batch", len(data), True)
    assert f.created_at == T0 // 1000 and f.expires_at == f.created_at + 3600
    assert f.location == store.location(f.id) == f"{store.root}/{f.id}"
    assert store.get(f.id, ALICE) == f
    assert b"".join(store.read(f, chunk_bytes=5)) == data
    assert list(store.lines(f)) == [b'{"custom_id": "a"}', b'{"custom_id": "b"}']
    assert _visible_names(store) == [f.id]
    assert store.list(ALICE) == ([f], False) and store.count(ALICE) == 1
    from openai.types import FileObject as OpenAIFile

    shown = OpenAIFile.model_validate(f.to_openai())
    assert (shown.id, shown.bytes, shown.purpose) == (f.id, len(data), "batch")
    assert shown.expires_at == f.expires_at


def test_lines_keep_empty_lines_carriage_returns_a_last_line_without_newline_and_long_lines(store):
    long_line = b"x" * (3 << 20)  # longer than the reader's buffer
    data = b"first\r\n\n" + long_line + b"\nlast"
    f = _upload(store, data)
    assert list(store.lines(f)) == [b"first\r", b"", long_line, b"last"]
    assert list(store.lines(_upload(store, b""))) == []


def test_a_file_over_the_limit_is_refused_and_leaves_nothing(store):
    with pytest.raises(FileTooLarge) as e, store.upload(ALICE, "big.jsonl", "batch", max_bytes=10) as up:
        up.write(b"12345")
        up.write(b"678901")
    assert e.value.limit == 10 and "10 bytes" in str(e.value)
    assert store.list(ALICE) == ([], False) and _visible_names(store) == []
    assert store.get(up.id, ALICE) is None
    f = _upload(store, b"1234567890", max_bytes=10)  # exactly the limit is fine
    assert f.bytes == 10


def test_an_upload_left_without_commit_or_dropped_leaves_no_visible_file(store):
    with store.upload(ALICE, "a.jsonl", "batch", max_bytes=100) as up:
        up.write(b"half")  # the block ends without a commit: aborted
    dropped = store.upload(ALICE, "b.jsonl", "batch", max_bytes=100)
    dropped.write(b"half of it")
    dropped_id = dropped.id
    del dropped  # a handler's task cancelled: nobody commits or aborts
    for file_id in (up.id, dropped_id):
        assert store.get(file_id, ALICE) is None
    assert store.list(ALICE) == ([], False) and store.count(ALICE) == 0
    assert _visible_names(store) == []


_KILLED_UPLOAD = """
import os, signal, sys
import redis
from batchinfer.config import Settings
from batchinfer.keys import Keys
from batchinfer.store.filestore import FileStore
store = FileStore(redis.Redis.from_url(sys.argv[1]), Keys("{t}"), Settings(files_dir=sys.argv[2]))
up = store.upload("key_aaaaaaaaaaaa", "in.jsonl", "batch", max_bytes=1 << 30)
for _ in range(12):  # 12 MiB: past one multipart part on an object store
    up.write(b"x" * (1 << 20))
print(up.id, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_process_killed_mid_upload_leaves_no_visible_file(store, settings, redis_server, tmp_path):
    done = subprocess.run([sys.executable, "-c", _KILLED_UPLOAD, redis_server.url, settings.files_dir],
                          capture_output=True, cwd=tmp_path, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
    file_id = done.stdout.decode().strip()
    assert file_id.startswith("file-")
    assert store.get(file_id, ALICE) is None and store.list(ALICE) == ([], False)
    assert _visible_names(store) == []
    assert store.fs.get_file_info(store.path(file_id)).type == pafs.FileType.NotFound
    root = store.path("x").rsplit("/", 1)[0]
    if store.is_local:  # the dead upload's bytes are there, under a hidden temporary name
        hidden = [i.size for i in store.fs.get_file_info(pafs.FileSelector(root)) if file_id in i.base_name]
        assert hidden and hidden[0] > 0
    # a later sweep clears what a dead upload left on a local disk (its hidden temporary file)
    store.sweep_expired(now_s=T0 // 1000 + 10**9)
    leftovers = [i.base_name for i in store.fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))]
    assert not [name for name in leftovers if file_id in name]


def test_another_key_can_neither_see_nor_list_nor_delete_a_file(store):
    f = _upload(store, b"secret\n")
    assert store.get(f.id, BOB) is None
    assert store.list(BOB) == ([], False) and store.count(BOB) == 0
    assert store.delete(f.id, BOB) is False
    assert store.get(f.id, ALICE) == f and b"".join(store.read(f)) == b"secret\n"


@pytest.mark.parametrize("bad", ["file-", "file-" + "g" * 24, "../file-" + "0" * 24, "x" * 5000, ""])
def test_malformed_ids_are_nobodys_files(store, bad):
    assert store.get(bad, ALICE) is None and store.delete(bad, ALICE) is False
    with pytest.raises(ValueError, match="not a file id"):
        store.location(bad)


def test_list_pages_in_both_orders_with_purpose_filter_and_same_millisecond_files(store, clock):
    made = []
    for i in range(14):
        clock.ms = T0 + i // 4  # groups of four files share a millisecond
        made.append(_upload(store, f"{i}\n".encode(), purpose="batch" if i % 3 else "user_data"))
    newest_first = [f.id for f in sorted(made, key=lambda f: (made.index(f) // 4, f.id), reverse=True)]
    for order, expected in (("desc", newest_first), ("asc", newest_first[::-1])):
        seen, after = [], None
        while True:
            page, has_more = store.list(ALICE, limit=3, after=after, order=order)
            seen += [f.id for f in page]
            if not has_more:
                break
            after = page[-1].id
        assert seen == expected, order
    batch_only = [i for i in newest_first if next(f for f in made if f.id == i).purpose == "batch"]
    page, has_more = store.list(ALICE, purpose="batch", limit=len(batch_only))
    assert [f.id for f in page] == batch_only and not has_more
    assert store.list(ALICE, purpose="batch", limit=len(batch_only) - 1)[1]
    assert store.list(ALICE, after="file-" + "0" * 24) == ([], False)
    with pytest.raises(ValueError, match="order"):
        store.list(ALICE, order="newest")


def test_files_expire_after_the_retention_or_sooner_when_asked(store, clock):
    kept = _upload(store, b"kept\n")
    short = _upload(store, b"short\n", expires_after_s=60)
    capped = _upload(store, b"capped\n", expires_after_s=10**9)
    assert short.expires_at == short.created_at + 60 and capped.expires_at == capped.created_at + 3600
    clock.ms += 61_000
    assert store.get(short.id, ALICE) is None and store.get(kept.id, ALICE) is not None
    assert sorted(f.id for f in store.list(ALICE)[0]) == sorted([kept.id, capped.id])
    assert store.sweep_expired() == 1
    assert store.fs.get_file_info(store.path(short.id)).type == pafs.FileType.NotFound
    assert store.count(ALICE) == 2
    clock.ms += 3600_000
    assert store.sweep_expired() == 2 and store.count(ALICE) == 0 and _visible_names(store) == []
    with pytest.raises(ValueError, match="expires_after"):
        store.upload(ALICE, "x", "batch", max_bytes=1, expires_after_s=0)


def test_retention_zero_keeps_files_until_deleted(redis_server, settings, clock):
    settings.files_retention_seconds = 0
    store = FileStore(redis_server.client(), Keys("{t}"), settings, clock=clock)
    f = _upload(store, b"forever\n")
    assert f.expires_at is None
    clock.ms += 10**12
    assert store.sweep_expired() == 0 and store.get(f.id, ALICE) == f
    assert _upload(store, b"a day\n", expires_after_s=86400).expires_at is not None


def test_delete_removes_the_bytes_then_the_record(store):
    f = _upload(store, b"gone soon\n")
    assert store.delete(f.id, ALICE) is True
    assert store.fs.get_file_info(store.path(f.id)).type == pafs.FileType.NotFound
    assert store.get(f.id, ALICE) is None and store.count(ALICE) == 0
    assert store.delete(f.id, ALICE) is False


def test_an_output_appears_once_the_exporter_has_written_it(store, settings):
    file_id = store.new_id()
    pending = store.add_output(file_id, ALICE, "batch_x_output.jsonl")
    assert pending.ready is False and pending.purpose == "batch_output" and pending.bytes is None
    assert store.add_output(file_id, ALICE, "batch_x_output.jsonl") == pending  # a retried job: same record
    with pytest.raises(ValueError, match="another key"):
        store.add_output(file_id, BOB, "x")
    assert store.get(file_id, ALICE) is None and store.list(ALICE) == ([], False)
    assert store.delete(file_id, ALICE) is False and store.count(ALICE) == 1  # the export still owns it
    # the exporter may name it (the file store is an allowed output prefix) and writes it as any output
    location = store.location(file_id)
    assert check_output(location, settings.results_root, settings.output_prefixes()) == location
    with atomic_output(resolve(location, settings.results_root)) as out:
        out.write(b'{"id": "r1"}\n')
    ready = store.get(file_id, ALICE)
    assert ready is not None and ready.ready and ready.bytes == 13
    assert list(store.lines(ready)) == [b'{"id": "r1"}']
    assert store.list(ALICE)[0] == [ready]
    assert store.get(file_id, BOB) is None


def test_upload_arguments_are_checked(store):
    with pytest.raises(ValueError, match="purpose"):
        store.upload(ALICE, "a.jsonl", "fine-tune", max_bytes=10)
    with pytest.raises(ValueError, match="filename"):
        store.upload(ALICE, "", "batch", max_bytes=10)
    up = store.upload(ALICE, "a.jsonl", "user_data", max_bytes=10)
    f = up.commit()
    with pytest.raises(ValueError, match="finished"):
        up.write(b"more")
    assert f.purpose == "user_data" and f.bytes == 0 and b"".join(store.read(f)) == b""


# -- the settings that place the store --------------------------------------------------------------

def test_files_root_defaults_below_the_results_root_as_an_absolute_file_uri(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert Settings(results_root="out").files_root() == (tmp_path / "out" / "files").as_uri()
    assert Settings(files_dir="my files").files_root() == (tmp_path / "my files").as_uri()
    assert Settings(files_dir="s3://bucket/prefix/").files_root() == "s3://bucket/prefix"
    env = {"BATCHINFER_FILES_DIR": "s3://b/p", "BATCHINFER_FILES_RETENTION_SECONDS": "60",
           "BATCHINFER_API_AUTH": "none", "BATCHINFER_API_SYNC_TIMEOUT_SECONDS": "1.5"}
    s = Settings.from_env(env)
    assert (s.files_root(), s.files_retention_seconds, s.api_auth, s.api_sync_timeout_seconds) == \
        ("s3://b/p", 60, "none", 1.5)


def test_output_prefixes_add_the_file_store_to_the_operators_list():
    s = Settings(files_dir="s3://bucket/files", output_uri_prefixes="s3://out,gs://x")
    assert s.output_prefixes() == "s3://out,gs://x,s3://bucket/files"
    assert Settings(files_dir="/srv/files").output_prefixes() == "file:///srv/files"
    with pytest.raises(ValueError, match="not an allowed destination"):
        check_output("s3://bucket/elsewhere/x", "results", s.output_prefixes())
