"""The clocks the daemons' time policies are handed (leases, holds, heartbeats, retention, timers).

A policy that decides by time takes its clock as a parameter, defaulting to the real one, instead of
calling ``time`` itself: a test hands it a fake clock and advances it, rather than sleeping the
policy's period out. Time kept by Redis itself (``PEXPIRE`` TTLs, ``XAUTOCLAIM``'s idle time) is the
server's and cannot be faked this way.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from batchinfer.protocol.rows import now_ms

Clock = Callable[[], float]
"""Seconds on a monotonic clock: intervals and deadlines inside one process (``time.monotonic``)."""

WallClock = Callable[[], int]
"""Milliseconds since the epoch: times stored in Redis or compared with stream ids (``now_ms``)."""

MONOTONIC: Clock = time.monotonic
WALL_MS: WallClock = now_ms
