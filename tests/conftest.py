"""Shared fixtures: a real redis-server on a free port, tiny HF checkpoints built on the fly."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A redis-server process the test owns: it can be stopped and restarted on the same port."""

    def __init__(self, directory: Path, port: int | None = None, *extra_args: str):
        self.dir = directory
        self.port = port or free_port()
        self.extra_args = list(extra_args)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.fail("redis-server is not on PATH (.ci/run installs it)")
        args = [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
                "--save", "", "--appendonly", "no", *self.extra_args]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis(port=self.port, socket_connect_timeout=0.2).ping()
                return self
            except (redis.exceptions.AuthenticationError, redis.exceptions.ResponseError):
                return self  # up, and asking for a password (a --requirepass or ACL server)
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop(kill=True)  # never leave a half-started server behind
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.05)

    def stop(self, kill: bool = False) -> None:
        if self.proc and self.proc.poll() is None:
            (self.proc.kill if kill else self.proc.terminate)()
            self.proc.wait(timeout=10)
        self.proc = None

    def client(self):
        import redis

        return redis.Redis.from_url(self.url)


@pytest.fixture
def redis_server(tmp_path):
    """A fresh redis-server for one test."""
    server = RedisServer(tmp_path).start()
    yield server
    server.stop(kill=True)


@pytest.fixture(scope="session")
def redis_session(tmp_path_factory):
    """One redis-server shared by a whole session; tests use distinct key prefixes."""
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop(kill=True)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """A tiny random Llama checkpoint with a byte-level tokenizer (float32). The compiled CPU library
    is built here too (once per checkout and source digest; never raises; `make test` builds it
    before pytest starts): a worker daemon a test starts then loads it, instead of compiling it for
    minutes inside a test's deadlines (a drain test that waits for a worker mid-batch saw the whole
    job finish during such a build)."""
    from batchinfer.kernels.cpu_ext import decode
    from batchinfer.workers.models.tiny import make_tiny_model

    decode.library()
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama", architecture="LlamaForCausalLM")


@pytest.fixture(scope="module")
def engine_factory(tiny_llama):
    """``make(**config)``: engines sharing one loaded tiny Llama and its tokenizer, each with its own
    KV cache (64 blocks unless ``num_kv_blocks`` says), queues and grammar backend."""
    from batchinfer.workers.engine.engine import Engine
    from batchinfer.workers.engine_config import EngineConfig

    base = Engine(EngineConfig(model=str(tiny_llama), num_kv_blocks=8))

    def make(**config):
        config.setdefault("num_kv_blocks", 64)
        engine_config = EngineConfig(model=str(tiny_llama), **config)
        return Engine(engine_config, model=base.model, tokenizer=base.tokenizer)

    return make


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _interpret_triton_without_cuda() -> None:
    """Without CUDA, Triton kernels run in Triton's CPU interpreter (tests/test_kernels_triton.py).
    The variable must be set before anything imports triton, hence here, at conftest import."""
    try:
        import torch

        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")
    except ImportError:
        pass


_interpret_triton_without_cuda()


@pytest.fixture(scope="module")
def redis_module(tmp_path_factory):
    """A redis-server for one test module whose tests share daemons and a queue (rq's queue key is global)."""
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop(kill=True)




@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """moto's S3-compatible server on a free loopback port (tests/s3_server.py): ``.endpoint``,
    ``.env()`` (the AWS_* variables a client needs; set them with monkeypatch), ``.make_bucket(name)``."""
    from s3_server import S3Server

    server = S3Server(tmp_path_factory.mktemp("s3")).start()
    yield server
    server.stop()


@pytest.fixture
def api_stack(redis_server, tiny_llama, tmp_path):
    """A started :class:`api_stack.ApiStack`: scheduler, exporter, a tiny-llama worker (loading in the
    background: ``wait_for_model()``), ``batchinfer api`` on a free port (ready). Closed after the
    test, its daemons' log tails printed (pytest shows them for a failing test)."""
    from api_stack import ApiStack

    stack = ApiStack(redis_server.url, tmp_path / "api-stack", tiny_llama)
    try:
        yield stack.start_all()
    finally:
        stack.close()
        print(stack.logs())


@pytest.fixture
def health_servers():
    """``start(registry=None, readiness=None)`` -> a started HealthServer on a free loopback port;
    every one started is stopped after the test."""
    from batchinfer.ops.httpserver import HealthServer

    started: list[HealthServer] = []

    def start(registry=None, readiness=None) -> HealthServer:
        http = HealthServer(0, registry, readiness, host="127.0.0.1").start()
        started.append(http)
        return http

    yield start
    for http in started:
        http.stop()
