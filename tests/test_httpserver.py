"""The daemons' HTTP server: /metrics, /healthz (liveness, stalled loops), /readyz (marks and probes)."""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import re
import socket
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import free_port
from daemons import START_TIMEOUT_S, wait_for
from prometheus_client import CollectorRegistry, Counter

from batchinfer.cli.runner import python_module
from batchinfer.config import Settings
from batchinfer.ops.httpserver import HealthServer, Readiness, probe, serve
from batchinfer.ops.startup import StartupError

CLI = python_module("batchinfer.cli")


def get(url: str, accept: str | None = None) -> tuple[int, bytes, str]:
    request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read(), response.headers["Content-Type"]
    except urllib.error.HTTPError as e:
        return e.code, e.read(), e.headers["Content-Type"]


@pytest.fixture
def server(health_servers):
    return health_servers


def test_metrics_are_served_in_text_and_openmetrics(server):
    registry = CollectorRegistry()
    Counter("batchinfer_demo_total", "demo", registry=registry).inc(3)
    http = server(registry)
    status, body, ctype = get(http.url + "/metrics")
    assert status == 200 and ctype.startswith("text/plain") and b"batchinfer_demo_total 3.0" in body
    status, body, ctype = get(http.url + "/metrics", accept="application/openmetrics-text")
    assert ctype.startswith("application/openmetrics-text") and body.rstrip().endswith(b"# EOF")


def test_readiness_follows_marks_and_probes(server):
    readiness = Readiness()
    readiness.mark("model", False, "loading weights")
    http = server(readiness=readiness)
    assert get(http.url + "/healthz")[:2] == (200, b"ok\n")
    status, body, _ = get(http.url + "/readyz")
    assert status == 503 and json.loads(body) == {"ready": False, "checks": {"model": "loading weights"}}
    readiness.mark("model", True)

    def refused() -> bool:
        raise ConnectionError("refused")

    readiness.add_probe("redis", refused)
    status, body, _ = get(http.url + "/readyz")
    assert status == 503
    assert json.loads(body)["checks"] == {"model": "ok", "redis": "ConnectionError: refused"}
    readiness.add_probe("redis", lambda: True)
    assert get(http.url + "/readyz")[0] == 200
    assert get(http.url + "/nope")[0] == 404


def test_a_stalled_loop_fails_liveness(server):
    now = [0.0]
    readiness = Readiness(stall_after=30, clock=lambda: now[0])
    http = server(readiness=readiness)
    assert get(http.url + "/healthz")[0] == 200  # not ticked yet: still starting (e.g. loading a model)
    readiness.tick()
    now[0] = 29.0
    assert get(http.url + "/healthz")[0] == 200
    now[0] = 45.0
    status, body, _ = get(http.url + "/healthz")
    assert status == 503 and b"no iteration for 45 s" in body
    readiness.tick()
    assert get(http.url + "/healthz")[0] == 200


def test_probe_command_exit_codes(server):
    readiness = Readiness()
    http = server(readiness=readiness)
    assert probe(http.url + "/readyz") == 0
    readiness.mark("redis", False, "unreachable")
    assert probe(http.url + "/readyz") == 1
    done = subprocess.run([*python_module("batchinfer.ops.httpserver"), http.url + "/readyz"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "HTTP 503" in done.stderr and "unreachable" in done.stderr
    http.stop()
    assert probe(http.url + "/healthz", timeout=1) == 1


def test_serve_is_off_without_a_port_and_a_busy_port_is_a_clear_error(server):
    assert serve(None, CollectorRegistry(), Readiness()) is None
    first = server()
    with pytest.raises(OSError, match=f"metrics port {first.port}"):
        HealthServer(first.port, host="127.0.0.1").start()
    with pytest.raises(ValueError, match="70000"):
        HealthServer(70000)


# -- which address the server listens on (issue 27: it used to be every interface) ---------------------


def reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=5):
            return True
    except OSError:
        return False


def second_loopback() -> bool:
    """Whether 127.0.0.2 is an address of this machine (Linux: all of 127/8 is on ``lo``)."""
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.2", 0))
        return True
    except OSError:
        return False


def other_address() -> str | None:
    """A non-loopback IPv4 address of this machine, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # UDP: sends nothing, only picks the outgoing interface
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address == "0.0.0.0" or ipaddress.ip_address(address).is_loopback else address


def test_by_default_the_server_listens_on_loopback_only(caplog):
    with caplog.at_level(logging.INFO, logger="batchinfer.ops.httpserver"), HealthServer(0) as http:
        port = http.port
        assert http.bound == f"127.0.0.1:{port}" and http.url == f"http://127.0.0.1:{port}"
        assert f"on http://127.0.0.1:{port}" in caplog.text and "no authentication" not in caplog.text
        assert reachable("127.0.0.1", port)
        if second_loopback():
            assert not reachable("127.0.0.2", port)
        other = other_address()
        if other is not None:
            assert not reachable(other, port)
    assert Settings.from_env(environ={}).metrics_host == "127.0.0.1"


def test_metrics_host_binds_what_was_asked(caplog):
    settings = Settings.from_env(environ={"BATCHINFER_METRICS_HOST": "0.0.0.0"})
    assert settings.metrics_host == "0.0.0.0"
    with caplog.at_level(logging.INFO, logger="batchinfer.ops.httpserver"):
        http = serve(0, CollectorRegistry(), Readiness(), settings.metrics_host)
    try:
        port = http.port
        assert http.bound == f"0.0.0.0:{port}" and http.url == f"http://127.0.0.1:{port}"
        # the log says the address actually bound, and that anyone reaching it may read it
        assert f"on http://0.0.0.0:{port} (no authentication" in caplog.text
        assert get(http.url + "/healthz")[0] == 200
        if second_loopback():
            assert reachable("127.0.0.2", port)
        other = other_address()
        if other is not None:
            assert reachable(other, port)
    finally:
        http.stop()
    with pytest.raises(StartupError, match=r"metrics port \d+ on 192\.0\.2\.1: .*--metrics-host"):
        HealthServer(0, host="192.0.2.1").start()  # an address this machine does not have
    with pytest.raises(ValueError, match="metrics host"):
        HealthServer(0, host="")


def _serving_address(log: Path, proc: subprocess.Popen) -> str:
    """The address a daemon's log line says it serves /metrics on (waits for the line)."""

    def found() -> str | None:
        line = re.search(r"/readyz on http://(\S+)", log.read_text(errors="replace"))
        return line.group(1) if line else None

    def alive() -> None:
        assert proc.poll() is None, f"the daemon exited ({proc.returncode}):\n{log.read_text()[-3000:]}"

    return wait_for(found, "the 'serving /metrics' log line", START_TIMEOUT_S, alive,
                    details=lambda: log.read_text(errors="replace")[-3000:])


@pytest.mark.parametrize(("daemon", "flags", "env", "host"), [
    ("scheduler", (), {}, "127.0.0.1"),  # the default
    ("scheduler", ("--metrics-host", "127.0.0.2"), {}, "127.0.0.2"),
    ("worker", ("--echo", "--model-name", "echo", "--metrics-host", "0.0.0.0"), {}, "0.0.0.0"),
    ("exporter", (), {"BATCHINFER_METRICS_HOST": "127.0.0.2"}, "127.0.0.2"),
])
def test_every_daemon_binds_its_metrics_host(redis_server, tmp_path, daemon, flags, env, host):
    if "127.0.0.2" in (host, *flags) and not second_loopback():
        pytest.skip("127.0.0.2 is not an address of this machine")
    port, log = free_port(), tmp_path / f"{daemon}.log"
    environ = {k: v for k, v in os.environ.items() if k != "BATCHINFER_METRICS_HOST"}
    environ.update(BATCHINFER_REDIS_URL=redis_server.url, BATCHINFER_PREFIX="{mh}", **env)
    with open(log, "ab") as out:
        proc = subprocess.Popen([*CLI, daemon, "--metrics-port", str(port), *flags], env=environ,
                                cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        assert _serving_address(log, proc).startswith(f"{host}:{port}")
        if host == "0.0.0.0":
            assert reachable("127.0.0.1", port)
            if second_loopback():
                assert reachable("127.0.0.2", port)
        else:
            assert reachable(host, port)
            assert not reachable("127.0.0.2" if host == "127.0.0.1" else "127.0.0.1", port)
        other = other_address()
        if other is not None:
            assert reachable(other, port) == (host == "0.0.0.0")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
