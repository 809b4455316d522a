"""A clock a test advances by hand, for the policies that take one (``batchinfer.clock``)."""

from __future__ import annotations

from batchinfer.protocol.rows import now_ms


class FakeClock:
    """Seconds that move only on :meth:`advance`. Called, it is a ``Clock``; :meth:`ms` is its
    ``WallClock`` (epoch milliseconds), so start it at the real time where Redis stream ids or
    stored times are compared with it (:meth:`from_now`)."""

    def __init__(self, start: float = 1000.0):
        self.now = start

    @classmethod
    def from_now(cls) -> FakeClock:
        return cls(now_ms() / 1000)

    def __call__(self) -> float:
        return self.now

    def ms(self) -> int:
        return round(self.now * 1000)

    def advance(self, seconds: float) -> None:
        assert seconds >= 0, "a clock does not go back"
        self.now += seconds
