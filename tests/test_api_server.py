"""The HTTP API's core: health endpoints, keys (401 in both vendors' shapes, revocation at once),
errors in the door's shape, JSON bodies, the access log, `api-keys`, `api` and `serve` as commands.

Servers are real (``batchinfer api`` subprocesses on a real Redis, driven by the official SDKs);
the in-process tests run the real app through Starlette's TestClient (JSON bodies, a 500)."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import urllib.request

import anthropic
import openai
import pytest
from api_stack import ApiStack, free_port
from daemons import CLI, wait_for
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from batchinfer.api.app import create_app, json_body
from batchinfer.config import Settings


@pytest.fixture
def api_only(redis_server, tmp_path):
    """``batchinfer api`` alone (no scheduler, no worker): what the key and error tests need."""
    stack = ApiStack(redis_server.url, tmp_path / "stack")
    try:
        stack.start_api("api")
        yield stack
    finally:
        stack.close()
        print(stack.logs())


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_health_ready_metrics_and_a_graceful_stop(api_only, redis_server):
    root = api_only.root_url
    assert _get(f"{root}/healthz")[0] == 200
    status, body = _get(f"{root}/readyz")
    assert status == 200
    assert json.loads(body) == {"ready": True, "checks": {"redis": "ok", "partitions": "ok"}}
    api_only.openai(api_only.key("alice")).files.list()
    status, metrics = _get(f"{root}/metrics")
    assert status == 200
    readyz = r'batchinfer_api_requests_total\{method="GET",route="/readyz",status="200"\} [1-9]'
    assert re.search(readyz, metrics)
    assert 'batchinfer_api_requests_total{method="GET",route="/v1/files",status="200"} 1.0' in metrics
    assert 'batchinfer_api_request_duration_seconds_count{method="GET",route="/v1/files"} 1.0' in metrics
    assert 'batchinfer_api_requests_in_flight{route="/metrics"} 1.0' in metrics  # this very request
    assert "process_resident_memory_bytes" in metrics

    redis_server.stop(kill=True)  # not ready without Redis, but alive
    status, body = _get(f"{root}/readyz")
    assert status == 503 and json.loads(body)["checks"]["redis"] != "ok"
    assert _get(f"{root}/healthz")[0] == 200
    assert api_only.stop("api") == 0  # SIGTERM: a clean exit


def test_keys_are_checked_in_openai_shape_and_a_revoke_acts_at_once(api_only):
    secret = api_only.key("alice")
    client = api_only.openai(secret)
    assert client.files.list().data == []
    for wrong in ("bik_not-a-key", secret + "x"):
        with pytest.raises(openai.AuthenticationError) as caught:
            api_only.openai(wrong).files.list()
        assert caught.value.status_code == 401
        assert caught.value.body["code"] == "invalid_api_key"
        assert caught.value.body["type"] == "invalid_request_error"
    missing = api_only.http().get("/v1/files")  # no Authorization header at all
    assert missing.status_code == 401
    assert missing.json()["error"]["code"] == "invalid_api_key"
    assert "Authorization: Bearer" in missing.json()["error"]["message"]

    api_only.api_keys.revoke("alice")
    with pytest.raises(openai.AuthenticationError):  # the very next request
        client.files.list()
    log = (api_only.tmp / "api.log").read_text()
    assert "GET /v1/files 200" in log and "key=alice" in log
    assert secret not in log


def test_keys_are_checked_in_anthropic_shape(api_only):
    secret = api_only.key("bob")
    assert api_only.anthropic(secret).messages.batches.list().data == []
    for wrong in ("bik_not-a-key", secret + "x"):
        with pytest.raises(anthropic.AuthenticationError) as caught:
            api_only.anthropic(wrong).messages.batches.list()
        assert caught.value.status_code == 401
        body = caught.value.body
        assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
        assert set(body["error"]) == {"type", "message"}
    missing = api_only.http().get("/v1/messages/batches")  # no key header at all
    assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
    # x-api-key works on OpenAI's door too, and Bearer on Anthropic's
    assert api_only.http().get("/v1/files", headers={"x-api-key": secret}).status_code == 200
    assert api_only.http(secret).get("/v1/messages/batches").status_code == 200
    api_only.api_keys.revoke("bob")
    with pytest.raises(anthropic.AuthenticationError):
        api_only.anthropic(secret).messages.batches.list()


def test_unknown_routes_and_methods_answer_in_the_doors_shape(api_only):
    secret = api_only.key("carol")
    with pytest.raises(openai.NotFoundError) as caught:
        api_only.openai(secret).get("/no-such-thing", cast_to=object)
    assert caught.value.body["message"] == "Invalid URL (GET /v1/no-such-thing): no such endpoint."
    with pytest.raises(anthropic.NotFoundError) as found:
        api_only.anthropic(secret).get("/v1/messages/no/such/thing", cast_to=object)
    assert found.value.body["error"]["type"] == "not_found_error"
    wrong_method = api_only.http(secret).delete("/v1/files")
    assert wrong_method.status_code == 405
    assert wrong_method.json()["error"]["message"] == \
        "Method DELETE not allowed for /v1/files (allowed: GET, HEAD, POST)."
    assert wrong_method.headers["allow"] == "GET, HEAD, POST"


def test_keys_survive_an_api_restart_and_replicas_share_them(api_only):
    secret = api_only.key("dave")
    other = api_only.start_api("api2")
    assert api_only.openai(secret, other).files.list().data == []
    api_only.restart_api()
    assert api_only.openai(secret).files.list().data == []


@pytest.mark.slow
def test_the_api_stack_fixture_serves_the_tiny_model(api_stack):
    api_stack.wait_for_model()
    client = api_stack.openai(api_stack.key("hank"))
    assert [m.id for m in client.models.list().data] == ["tiny-llama"]
    reply = client.chat.completions.create(model="tiny-llama", max_tokens=3,
                                           messages=[{"role": "user", "content": "hi"}])
    assert reply.usage.completion_tokens >= 1
    assert set(api_stack.procs) == {"scheduler", "exporter", "worker", "api"}


# -- the app in-process ----------------------------------------------------------------------------


async def _echo(request: Request) -> JSONResponse:
    return JSONResponse(await json_body(request, max_bytes=64))


async def _echo_default_limit(request: Request) -> JSONResponse:
    return JSONResponse(await json_body(request))


def _boom(request: Request) -> JSONResponse:
    raise RuntimeError("a bug")


@pytest.fixture
def app_client(redis_server, tmp_path):
    settings = Settings(redis_url=redis_server.url, prefix="{inproc}", files_dir=str(tmp_path / "files"),
                        api_max_body_bytes=1000)
    app = create_app(settings)
    app.router.routes += [Route("/v1/echo", _echo, methods=["POST"]),
                          Route("/v1/messages/echo", _echo, methods=["POST"]),
                          Route("/v1/echo-default", _echo_default_limit, methods=["POST"]),
                          Route("/v1/boom", _boom), Route("/v1/messages/boom", _boom)]
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


def test_json_bodies_are_read_within_a_limit_with_errors_that_say_where(app_client):
    assert app_client.post("/v1/echo", json={"a": 1}).json() == {"a": 1}
    bad = app_client.post("/v1/echo", content=b'{"a": 1,\n "b": }')
    assert bad.status_code == 400
    assert bad.json()["error"]["message"] == ("invalid JSON in the request body: Expecting value at line 2 "
                                              "column 7.")
    assert app_client.post("/v1/echo", content=b"[1, 2]").json()["error"]["message"] == \
        "The request body must be a JSON object, not a JSON array."
    assert app_client.post("/v1/echo", content=b"").status_code == 400
    assert app_client.post("/v1/echo", content=b'{"a": "\xff"}').status_code == 400
    too_big = app_client.post("/v1/echo", json={"a": "x" * 100})  # Content-Length says so
    assert too_big.status_code == 413 and "limit of 64 bytes" in too_big.json()["error"]["message"]
    streamed = app_client.post("/v1/echo", content=iter([b'{"a": "', b"x" * 100, b'"}']))  # chunked
    assert streamed.status_code == 413
    assert app_client.post("/v1/echo-default", json={"a": "x" * 2000}).status_code == 413  # the setting
    assert app_client.post("/v1/echo-default", json={"a": "x" * 900}).status_code == 200
    anthropic_door = app_client.post("/v1/messages/echo", content=b"{")
    assert anthropic_door.status_code == 400
    assert anthropic_door.json()["error"]["type"] == "invalid_request_error"
    assert anthropic_door.json()["type"] == "error"


def test_an_unexpected_error_is_a_logged_500_in_the_doors_shape(app_client, caplog):
    caplog.set_level(logging.INFO, logger="batchinfer.api.access")
    reply = app_client.get("/v1/boom")
    assert reply.status_code == 500
    assert reply.json()["error"]["type"] == "server_error" and "a bug" not in reply.text
    assert any(r.exc_info and "a bug" in str(r.exc_info[1]) for r in caplog.records)
    reply = app_client.get("/v1/messages/boom")
    assert reply.status_code == 500 and reply.json()["error"]["type"] == "api_error"
    assert any(r.name == "batchinfer.api.access" and "GET /v1/boom 500" in r.getMessage()
               for r in caplog.records)


# -- commands --------------------------------------------------------------------------------------


def test_api_keys_commands_create_list_and_revoke(api_only):
    made = api_only.cli("api-keys", "create", "erin", "--max-files", "3", "--json")
    assert made.returncode == 0, made.stderr
    key = json.loads(made.stdout)
    assert key["name"] == "erin" and key["max_files"] == 3 and key["secret"].startswith("bik_")
    plain = api_only.cli("api-keys", "create", "frank")
    assert plain.returncode == 0, plain.stderr
    frank = plain.stdout.strip()  # the secret alone on stdout; the note on stderr
    assert frank.startswith("bik_") and "shown only this once" in plain.stderr
    assert api_only.openai(frank).files.list().data == []
    taken = api_only.cli("api-keys", "create", "erin")
    assert taken.returncode == 2 and "erin" in taken.stderr

    listed = api_only.cli("api-keys", "list", "--json")
    assert [k["name"] for k in json.loads(listed.stdout)] == ["erin", "frank"]
    table = api_only.cli("api-keys", "list")
    for output in (listed.stdout, table.stdout):
        assert key["secret"] not in output and frank not in output
    assert "erin" in table.stdout and key["id"] in table.stdout

    revoked = api_only.cli("api-keys", "revoke", "frank")
    assert revoked.returncode == 0 and "revoked API key 'frank'" in revoked.stdout
    with pytest.raises(openai.AuthenticationError):
        api_only.openai(frank).files.list()
    by_id = api_only.cli("api-keys", "revoke", key["id"], "--json")
    assert json.loads(by_id.stdout)["revoked_at"] is not None
    unknown = api_only.cli("api-keys", "revoke", "nobody")
    assert unknown.returncode == 4 and "nobody" in unknown.stderr


def test_api_keys_set_limits_takes_effect_at_once(api_only):
    secret = api_only.cli("api-keys", "create", "gina").stdout.strip()
    client = api_only.openai(secret)
    changed = api_only.cli("api-keys", "set-limits", "gina", "--max-files", "1", "--json")
    assert changed.returncode == 0, changed.stderr
    assert json.loads(changed.stdout)["max_files"] == 1
    client.files.create(file=("a.jsonl", b"{}\n"), purpose="batch")
    with pytest.raises(openai.RateLimitError):  # the second file is over the key's new limit
        client.files.create(file=("b.jsonl", b"{}\n"), purpose="batch")
    back = api_only.cli("api-keys", "set-limits", "gina", "--max-files", "default")
    assert back.returncode == 0 and "max_files default" in back.stdout
    assert client.files.create(file=("b.jsonl", b"{}\n"), purpose="batch").bytes == 3
    assert api_only.cli("api-keys", "set-limits", "gina").returncode == 2  # nothing to set
    bad = api_only.cli("api-keys", "set-limits", "gina", "--max-files", "0")
    assert bad.returncode == 2 and "positive integer" in bad.stderr
    assert api_only.cli("api-keys", "set-limits", "nobody", "--max-files", "2").returncode == 4


def test_api_says_when_its_port_is_taken(tmp_path, redis_server):
    with socket.create_server(("127.0.0.1", 0)) as held:
        port = held.getsockname()[1]
        env = {**os.environ, "BATCHINFER_REDIS_URL": redis_server.url}
        out = subprocess.run([*CLI, "api", "--port", str(port)], env=env, capture_output=True, text=True,
                             timeout=120, cwd=tmp_path)
    assert out.returncode == 9
    assert f"cannot listen on 127.0.0.1:{port}" in out.stderr and "--port" in out.stderr


@pytest.mark.slow
def test_api_with_several_worker_processes(redis_server, tmp_path):
    stack = ApiStack(redis_server.url, tmp_path / "stack")
    try:
        stack.start_api("api", args=("--workers", "2"))
        secret = stack.key("gina")
        for _ in range(4):  # whichever process answers knows the key (all state is in Redis)
            assert stack.openai(secret).files.list().data == []
        assert stack.stop("api") == 0
    finally:
        stack.close()
        print(stack.logs())


def _self_signed(folder) -> tuple[str, str]:
    """A key and a certificate for 127.0.0.1 (PEM files in ``folder``)."""
    import datetime as dt
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=1))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    key_path, cert_path = folder / "key.pem", folder / "cert.pem"
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(key_path), str(cert_path)


def test_api_serves_tls_with_uvicorns_options(redis_server, tmp_path):
    import ssl

    import httpx2

    stack = ApiStack(redis_server.url, tmp_path / "stack")
    key_file, cert_file = _self_signed(tmp_path)
    port = free_port()
    try:
        stack.start("api", "api", "--port", str(port), "--ssl-keyfile", key_file, "--ssl-certfile", cert_file)
        trust = ssl.create_default_context(cafile=cert_file)

        def ready() -> bool:
            try:
                url = f"https://127.0.0.1:{port}/readyz"
                with urllib.request.urlopen(url, context=trust, timeout=2) as reply:
                    return reply.status == 200
            except OSError:
                return False

        stack.until(ready, 60, "the API over TLS")
        client = openai.OpenAI(base_url=f"https://127.0.0.1:{port}/v1", api_key=stack.key("tls"),
                               max_retries=0, http_client=httpx2.Client(verify=trust))
        assert client.files.list().data == []
        with pytest.raises(OSError):  # plain HTTP on the TLS port gets no answer
            urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5).read()
        client.close()  # an idle TLS connection would hold the graceful stop (until its timeout)
        assert stack.stop("api") == 0
    finally:
        stack.close()
        print(stack.logs())


@pytest.mark.slow
def test_serve_answers_the_openai_sdk_and_stops_on_sigterm(tiny_llama, tmp_path):
    port = free_port()
    log_dir = tmp_path / "logs"
    env = {**os.environ, "BATCHINFER_RESULTS_ROOT": str(tmp_path / "results"), "OMP_NUM_THREADS": "1"}
    env.pop("BATCHINFER_REDIS_URL", None)
    args = ["serve", "--model", str(tiny_llama), "--port", str(port), "--device", "cpu",
            "--logs", str(log_dir)]
    serve = subprocess.Popen([*CLI, *args], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        banner = []
        assert serve.stdout is not None
        for line in serve.stdout:  # the banner comes once the API is ready
            banner.append(line)
            if "from openai import OpenAI" in line:
                break
        text = "".join(banner)
        assert f"batchinfer API on http://127.0.0.1:{port}/v1" in text, text
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        wait_for(lambda: [m.id for m in client.models.list().data] == ["tiny-llama"], "the worker", 180,
                 alive=lambda: serve.poll() is None)
        reply = client.chat.completions.create(model="tiny-llama", max_tokens=4,
                                               messages=[{"role": "user", "content": "hello"}])
        assert reply.choices[0].message.content is not None and reply.usage.completion_tokens >= 1
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=60) == 0
        with pytest.raises(openai.APIConnectionError):  # everything it started is gone
            client.models.list()
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait(timeout=10)
        for path in sorted(log_dir.glob("*.log")):
            print(f"--- {path.name}\n" + path.read_text(errors="replace")[-3000:])


def test_serve_refuses_a_taken_port_before_starting_anything(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as held:
        port = held.getsockname()[1]
        out = subprocess.run([*CLI, "serve", "--model", "tiny", "--echo", "--port", str(port)],
                             capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 9 and f"cannot listen on 127.0.0.1:{port}" in out.stderr
    assert "redis:" not in out.stderr  # nothing was started


@pytest.mark.slow
def test_serve_stops_when_a_daemon_dies_and_shows_its_log(tmp_path):
    not_a_model = tmp_path / "empty"
    not_a_model.mkdir()
    out = subprocess.run([*CLI, "serve", "--model", str(not_a_model), "--port", str(free_port()), "--device",
                          "cpu"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 8, out.stderr
    assert "error: worker-0 exited with code 9" in out.stderr
    assert "config.json not found" in out.stderr  # the worker's log tail
    assert "logs kept in" in out.stderr


def test_accepted_connections_send_at_once():
    """Without TCP_NODELAY a kept-alive reply's body waited ~40 ms for the client's delayed ACK
    (bench/api_bench.py found it): the listener has it set, and what it accepts inherits it."""
    from batchinfer.api.server import listen

    sock = listen("127.0.0.1", 0)
    try:
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        with socket.create_connection(sock.getsockname()):
            accepted, _ = sock.accept()
            with accepted:
                assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        sock.close()
