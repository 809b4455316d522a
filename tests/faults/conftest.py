"""Fixtures of the fault-injection suite: a fresh redis-server per test, daemon stacks that always
stop (and print their logs, which pytest shows for a failing test), and result checks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TESTS = str(Path(__file__).resolve().parents[1])
if TESTS not in sys.path:  # tests/conftest.py does it too; this folder's tests need it either way
    sys.path.insert(0, TESTS)

from daemons import FAULT_ENV, Stack, TcpProxy  # noqa: E402


@pytest.fixture
def stacks(tmp_path):
    """``stacks(redis_url, **env)`` -> a :class:`Stack`; all are closed and their logs printed. Ask for
    the Redis fixture before this one (``(redis_server, stacks)``): fixtures end in reverse order, and
    daemons stopped after their Redis cannot drain (each waits out its stop timeout: ~1 min a test)."""
    made: list[Stack] = []

    def make(redis_url: str, **env: str) -> Stack:
        folder = tmp_path / f"stack{len(made)}"
        folder.mkdir()
        stack = Stack(redis_url, folder, env={**FAULT_ENV, **env})
        made.append(stack)
        return stack

    yield make
    for stack in made:
        stack.close()
        print(stack.logs())


@pytest.fixture
def proxy(redis_server):
    """A cuttable TCP link to the test's redis-server."""
    link = TcpProxy(redis_server.port)
    yield link
    link.close()
