"""The synchronous endpoints (batchinfer/api/sync_routes.py, docs/api.md "Synchronous endpoints").

- end to end (``api_stack``: scheduler, tiny-llama worker, ``batchinfer api``), through the official
  ``openai`` and ``anthropic`` SDKs: chat (the same text as ``Client.request`` at temperature 0),
  completions, responses, messages, the models list, an unserved model (404 naming the served),
  ``stream: true`` (400); a client that goes away has its request cancelled;
- in process (the app under uvicorn in a thread, no scheduler: nothing is ever answered): the
  timeout (504, the request cancelled), bad bodies, and the unserved model in both error shapes;
- the pieces: every form reaches the scheduler at ``api_sync_priority``; rows shaped as the SDKs
  parse them (embeddings here: the stack serves no embedding model).
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import uuid

import anthropic
import httpx2 as httpx
import openai
import pytest
import uvicorn
from anthropic.types import Message
from daemons import wait_until
from openai.types import Completion, CreateEmbeddingResponse
from openai.types.chat import ChatCompletion
from openai.types.responses import Response
from output_lines import CHAT, CMPL, EMB, RESP, completed, output, parse_exactly

from batchinfer.api.app import create_app
from batchinfer.api.errors import ApiError
from batchinfer.api.sync_routes import answer, intake_entry
from batchinfer.config import Settings
from batchinfer.keys import Keys
from batchinfer.protocol.entries import MESSAGES_URL
from batchinfer.protocol.rows import ResultRow, encode_vector
from batchinfer.redis_conn import as_text
from batchinfer.scheduler.daemon import SchedulerDaemon
from batchinfer.scheduler.staging import Staging
from batchinfer.store.registry import Registry
from batchinfer.workers.service.echo_engine import EchoEngine, byte_tokenizer_files

MODEL = "tiny-llama"
CHAT_BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 8,
             "temperature": 0}


# -- end to end, through the SDKs -------------------------------------------------------------------


@pytest.mark.slow
def test_the_sdks_get_their_objects_from_the_queue(api_stack):
    api_stack.wait_for_model()
    secret = api_stack.key("sync")
    client, claude = api_stack.openai(secret), api_stack.anthropic(secret)

    chat = client.chat.completions.create(**CHAT_BODY)
    assert isinstance(chat, ChatCompletion) and chat.object == "chat.completion" and chat.model == MODEL
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 8
    line = {"custom_id": "same", "method": "POST", "url": CHAT, "body": CHAT_BODY}
    row = api_stack.client.request(line, timeout=60)
    assert row.status == "completed" and chat.choices[0].message.content == row.output_text

    text = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0)
    assert isinstance(text, Completion) and text.object == "text_completion"
    assert text.usage.completion_tokens == 5
    assert isinstance(text.choices[0].text, str)

    response = client.responses.create(model=MODEL, input="Hello", max_output_tokens=6, temperature=0)
    assert isinstance(response, Response) and response.status in ("completed", "incomplete")
    assert response.usage.output_tokens == 6 and isinstance(response.output_text, str)

    msg = claude.messages.create(model=MODEL, max_tokens=7, messages=[{"role": "user", "content": "Hi"}])
    assert isinstance(msg, Message) and msg.role == "assistant" and msg.model == MODEL
    assert (msg.stop_reason, msg.usage.output_tokens) == ("max_tokens", 7) or (
        msg.stop_reason == "end_turn" and msg.usage.output_tokens < 7)  # the tiny model's EOS

    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL] and models.data[0].owned_by == "batchinfer"
    assert models.data[0].created > 1_600_000_000 and client.models.retrieve(MODEL).id == MODEL

    with pytest.raises(openai.NotFoundError) as unserved:
        client.chat.completions.create(**{**CHAT_BODY, "model": "gpt-4o"})
    assert "'gpt-4o'" in unserved.value.message and MODEL in unserved.value.message
    with pytest.raises(anthropic.NotFoundError) as unserved_too:
        claude.messages.create(model="claude-x", max_tokens=5, messages=[{"role": "user", "content": "Hi"}])
    assert MODEL in unserved_too.value.message
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    with pytest.raises(openai.BadRequestError) as streaming:
        client.chat.completions.create(**CHAT_BODY, stream=True)
    assert "stream" in streaming.value.message and "not supported" in streaming.value.message
    with pytest.raises(openai.BadRequestError) as bad:  # the scheduler's invalid_request row, as a 400
        client.chat.completions.create(**{**CHAT_BODY, "temperature": -1})
    assert bad.value.code == "invalid_request" and "temperature" in bad.value.message
    with pytest.raises(openai.AuthenticationError):
        api_stack.openai("bik_wrong").models.list()


@pytest.mark.slow
def test_a_client_that_goes_away_has_its_request_cancelled(api_stack):
    api_stack.wait_for_model()
    secret = api_stack.key("leaver")
    r, keys = api_stack.client.redis, api_stack.client.keys
    api_stack.send("scheduler", signal.SIGSTOP)  # the request waits in the intake: it cannot finish first
    try:
        with httpx.Client(base_url=api_stack.root_url, timeout=1.0) as http, pytest.raises(httpx.ReadTimeout):
            http.post("/v1/chat/completions", json=CHAT_BODY, headers={"Authorization": f"Bearer {secret}"})
        cancelled = api_stack.until(lambda: r.zrange(keys.cancelled_requests, 0, -1), 30, "the cancel")
    finally:
        api_stack.send("scheduler", signal.SIGCONT)
    [request_id] = [as_text(m) for m in cancelled]
    [(_, entry)] = r.xrange(keys.requests, min=request_id, max=request_id)
    assert json.loads(entry[b"body"])["body"] == CHAT_BODY  # the request the client sent

    def row():
        for _, fields in r.xrange(keys.results("direct")):
            found = ResultRow.from_json(fields[b"row"])
            if found.request_id == request_id:
                return found
        return None

    got = api_stack.until(row, 60, "the cancelled request's row")
    assert (got.status, got.error_code, got.worker) == ("cancelled", "cancelled", None)  # never dispatched
    api_stack.until(lambda: not r.keys(keys.reply("*")), 30, "the reply stream deleted once its row came")


# -- in process: the app under uvicorn, no scheduler --------------------------------------------------


class Server:
    """``create_app(settings)`` served by uvicorn in a thread on a free port."""

    def __init__(self, settings: Settings):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        config = uvicorn.Config(create_app(settings), host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started, timeout=30, what="uvicorn started")

    def http(self, timeout: float = 30) -> httpx.Client:
        return httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=timeout)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture
def served(redis_server):
    """The app (no keys needed, a 1 s sync timeout) and a live worker entry for model ``echo``; no
    scheduler runs, so no request is ever answered."""
    prefix = f"{{s{uuid.uuid4().hex[:6]}}}"
    settings = Settings(redis_url=redis_server.url, prefix=prefix, api_auth="none",
                        api_sync_timeout_seconds=1.0, results_root=str(redis_server.dir))
    r, keys = redis_server.client(), Keys(prefix)
    registry = Registry(r, keys)
    registry.register_model("echo", byte_tokenizer_files(), EchoEngine().capacity())
    registry.heartbeat_worker("w1", {"model": "echo"}, ttl=600)
    server = Server(settings)
    try:
        yield server, r, keys
    finally:
        server.close()


def test_no_answer_in_time_is_a_504_and_cancels_the_request(served):
    server, r, keys = served
    with server.http() as http:
        reply = http.post("/v1/chat/completions", json={**CHAT_BODY, "model": "echo"})
    assert reply.status_code == 504, reply.text
    assert reply.json()["error"]["code"] == "timeout" and "1 s" in reply.json()["error"]["message"]
    [(entry_id, _)] = r.xrange(keys.requests)
    assert [as_text(m) for m in r.zrange(keys.cancelled_requests, 0, -1)] == [as_text(entry_id)]
    assert not r.keys(keys.reply("*"))  # its reply stream is gone


def test_bad_bodies_and_unserved_models_are_answered_at_once_in_the_doors_shape(served):
    server, r, keys = served
    with server.http() as http:
        bad = http.post("/v1/chat/completions", content=b'{"model": ',
                        headers={"content-type": "application/json"})
        assert bad.status_code == 400 and "invalid JSON" in bad.json()["error"]["message"]
        stream = http.post("/v1/completions", json={"model": "echo", "prompt": "x", "stream": True})
        assert stream.status_code == 400 and stream.json()["error"]["param"] == "stream"
        no_model = http.post("/v1/responses", json={"input": "x"})
        assert no_model.status_code == 400 and no_model.json()["error"]["param"] == "model"
        unserved = http.post("/v1/chat/completions", json={**CHAT_BODY, "model": "ghost"})
        assert unserved.status_code == 404 and unserved.json()["error"]["code"] == "model_not_found"
        assert "served models: echo" in unserved.json()["error"]["message"]
        claude = http.post("/v1/messages", json={"model": "ghost", "max_tokens": 3, "messages": []})
        assert claude.status_code == 404
        assert claude.json()["type"] == "error" and claude.json()["error"]["type"] == "not_found_error"
        assert "served models: echo" in claude.json()["error"]["message"]
        listed = http.get("/v1/models").json()
        assert listed["object"] == "list" and [m["id"] for m in listed["data"]] == ["echo"]
    assert r.xlen(keys.requests) == 0  # none of them was sent


# -- the pieces --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("url", "body"), [
    (CHAT, {"model": "echo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "priority": 5}),  # a body's own priority does not lift it out of the sync tier
    (CMPL, {"model": "echo", "prompt": "hi", "max_tokens": 3}),
    (RESP, {"model": "echo", "input": "hi", "max_output_tokens": 3}),
    (MESSAGES_URL, {"model": "echo", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}),
])
def test_each_form_is_staged_at_the_sync_priority(redis_server, url, body):
    keys = Keys(f"{{p{uuid.uuid4().hex[:6]}}}")
    r = redis_server.client()
    Registry(r, keys).register_model("echo", byte_tokenizer_files(), EchoEngine().capacity())  # no worker
    settings = Settings(prefix=keys.prefix, api_sync_priority=1234)
    entry = intake_entry(url, body, settings, keys.reply("x"))
    assert entry.hold_seconds == 0 and entry.reply_to == keys.reply("x")
    r.xadd(keys.requests, entry.to_fields())
    sched = SchedulerDaemon(r, settings)
    wait_until(lambda: Staging(r, keys).count("echo") == 1, timeout=10, tick=sched.run_once, what="staged")
    assert Staging(r, keys).members("echo") == [("1234:direct", 1234)]
    assert not r.exists(keys.reply("x"))  # no error row


def test_rows_are_answered_as_the_sdks_parse_them():
    parse_exactly(ChatCompletion, answer(CHAT, completed(CHAT)))
    parse_exactly(Completion, answer(CMPL, completed(CMPL)))
    parse_exactly(Response, answer(RESP, completed(RESP)))
    vectors = [[0.25, 0.5], [1.0, 0.0]]
    row = {"request_id": "1-0", "model": "minilm", "status": "completed", "prompt_tokens": 4, "url": EMB,
           "embeddings": [encode_vector(v) for v in vectors], "pooling_params": {}}
    emb = parse_exactly(CreateEmbeddingResponse, answer(EMB, row))
    assert [d.embedding for d in emb.data] == vectors
    msg = answer(MESSAGES_URL, completed(MESSAGES_URL, output(text="Hi there", finish="length")))
    parsed = Message.model_validate(msg, strict=True)
    assert parsed.content[0].text == "Hi there" and parsed.stop_reason == "max_tokens"
    assert parsed.usage.service_tier == "standard"


@pytest.mark.parametrize(("code", "status"), [("invalid_request", 400), ("prompt_too_long", 400),
                                              ("invalid_json", 400), ("unknown_model", 404),
                                              ("engine_error", 500), ("cancelled", 500)])
def test_a_row_that_did_not_complete_is_an_error_by_its_code(code, status):
    row = {"status": "failed", "error_code": code, "error_message": f"why: {code}"}
    with pytest.raises(ApiError) as e:
        answer(CHAT, row)
    assert (e.value.status, e.value.code, e.value.message) == (status, code, f"why: {code}")

