"""The daemons' HTTP server: /metrics, /healthz (liveness, stalled loops), /readyz (marks and probes)."""

from __future__ import annotations

import json
import subprocess
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter

from batchinfer.cli.runner import python_module
from batchinfer.ops.httpserver import HealthServer, Readiness, probe, serve


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
