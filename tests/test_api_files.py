"""OpenAI's Files API (batchinfer/api/files_routes.py) through the official openai SDK against a real
``batchinfer api`` process, Redis and file store: upload, retrieve, download, list, delete, limits,
and keys that cannot see each other's files."""

from __future__ import annotations

import os
import uuid

import openai
import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(redis_module, tmp_path_factory):
    """``batchinfer api`` alone (files need no scheduler or worker), shared by this module's tests."""
    from api_stack import ApiStack

    s = ApiStack(redis_module.url, tmp_path_factory.mktemp("files-api"))
    try:
        s.start_api("api")
        yield s
    finally:
        s.close()
        print(s.logs())


def new_client(stack, **limits):
    return stack.openai(stack.key(f"k-{uuid.uuid4().hex[:8]}", **limits))


def stored(stack) -> set[str]:
    """Every name in the file store's folder (temporary names of uploads included)."""
    folder = stack.tmp / "files"
    return set(os.listdir(folder)) if folder.exists() else set()


def test_upload_retrieve_download_list_delete(stack):
    client = new_client(stack)
    data = b"".join(b'{"custom_id": "r%d", "n": "%s"}\n' % (i, b"x" * (i % 97)) for i in range(60_000))
    assert len(data) > 3 << 20  # several network chunks and store writes
    f = client.files.create(file=("input.jsonl", data), purpose="batch")
    assert f.id.startswith("file-") and f.bytes == len(data) and f.filename == "input.jsonl"
    assert f.purpose == "batch" and f.status == "processed" and f.object == "file"
    assert client.files.retrieve(f.id).bytes == len(data)
    assert client.files.content(f.id).content == data
    assert [x.id for x in client.files.list()] == [f.id]
    deleted = client.files.delete(f.id)
    assert deleted.deleted and deleted.id == f.id
    with pytest.raises(openai.NotFoundError, match="No such File object"):
        client.files.retrieve(f.id)
    with pytest.raises(openai.NotFoundError):
        client.files.content(f.id)
    assert f.id not in stored(stack)  # its bytes are gone too


def test_expires_after_is_kept_and_a_bad_purpose_is_refused(stack):
    client = new_client(stack)
    f = client.files.create(file=("a.jsonl", b"{}\n"), purpose="user_data",
                            expires_after={"anchor": "created_at", "seconds": 3600})
    assert f.purpose == "user_data" and f.expires_at == f.created_at + 3600
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("a.jsonl", b"{}\n"), purpose="fine-tune")
    assert e.value.body["param"] == "purpose" and "fine-tune" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("a.jsonl", b"{}\n"), purpose="batch",
                            expires_after={"anchor": "created_at", "seconds": 5})
    assert e.value.body["param"] == "expires_after.seconds"


def test_the_purpose_may_come_after_the_file(stack):
    secret = stack.key(f"raw-{uuid.uuid4().hex[:8]}")
    boundary = "b0undary"
    body = (f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="late.jsonl"\r\n'
            f'Content-Type: application/octet-stream\r\n\r\n{{"a": 1}}\n\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nuser_data\r\n'
            f'--{boundary}--\r\n').encode()
    with stack.http(secret) as http:
        reply = http.post("/v1/files", content=body,
                          headers={"content-type": f"multipart/form-data; boundary={boundary}"})
        assert reply.status_code == 200, reply.text
        assert reply.json()["purpose"] == "user_data" and reply.json()["bytes"] == 9
        # a body cut before its closing boundary stores nothing
        cut = body[:body.index(b"\r\n--" + boundary.encode() + b"--")]
        reply = http.post("/v1/files", content=cut,
                          headers={"content-type": f"multipart/form-data; boundary={boundary}"})
        assert reply.status_code == 400, reply.text
        assert len(http.get("/v1/files").json()["data"]) == 1


def test_a_file_over_the_keys_limit_is_refused_413_and_leaves_nothing(stack):
    client = new_client(stack, max_file_bytes=100_000)
    before = stored(stack)
    with pytest.raises(openai.APIStatusError) as e:
        client.files.create(file=("big.jsonl", b"x" * 300_000), purpose="batch")
    assert e.value.status_code == 413 and "100000" in e.value.body["message"]
    assert list(client.files.list()) == []
    assert stored(stack) == before  # no temporary left behind either
    assert client.files.create(file=("ok.jsonl", b"x" * 100_000), purpose="batch").bytes == 100_000


def test_too_many_files_is_429(stack):
    client = new_client(stack, max_files=2)
    for i in range(2):
        client.files.create(file=(f"{i}.jsonl", b"{}\n"), purpose="batch")
    with pytest.raises(openai.RateLimitError) as e:
        client.files.create(file=("2.jsonl", b"{}\n"), purpose="batch")
    assert e.value.status_code == 429 and e.value.body["code"] == "files_limit_exceeded"


def test_list_pages_with_after_and_order(stack):
    client = new_client(stack)
    ids = [client.files.create(file=(f"{i}.jsonl", b"{}\n"), purpose="batch").id for i in range(5)]
    ids += [client.files.create(file=("u.jsonl", b"{}\n"), purpose="user_data").id]
    page = client.files.list(limit=2)
    assert [f.id for f in page.data] == ids[::-1][:2] and page.has_more
    nxt = client.files.list(limit=2, after=page.data[-1].id)
    assert [f.id for f in nxt.data] == ids[::-1][2:4]
    assert [f.id for f in client.files.list(limit=2)] == ids[::-1]  # the SDK follows `after` to the end
    assert [f.id for f in client.files.list(order="asc", purpose="batch")] == ids[:5]
    last = client.files.list(limit=6)
    assert len(last.data) == 6 and not last.has_more
    with pytest.raises(openai.BadRequestError):
        client.files.list(limit=0)
    with pytest.raises(openai.BadRequestError):
        client.files.list(order="sideways")  # type: ignore[arg-type]


def test_keys_cannot_see_each_others_files(stack):
    alice, bob = new_client(stack), new_client(stack)
    f = alice.files.create(file=("secret.jsonl", b"alice's\n"), purpose="batch")
    for call in (bob.files.retrieve, bob.files.content, bob.files.delete):
        with pytest.raises(openai.NotFoundError) as e:
            call(f.id)
        assert "secret" not in e.value.response.text and "alice" not in e.value.response.text
    assert list(bob.files.list()) == []
    assert alice.files.content(f.id).content == b"alice's\n"  # bob's delete did nothing


def test_no_key_is_401(stack):
    with pytest.raises(openai.AuthenticationError):
        stack.openai("bik_not-a-key").files.list()
