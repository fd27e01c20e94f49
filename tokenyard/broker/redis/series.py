"""The dashboard's recorded series on Redis: one stream of every gateway's points, trimmed by
time on each append (XADD MINID), read by range from a stream id of the time asked for."""

from __future__ import annotations

from tokenyard.broker.redis.connection import RedisConnection, text
from tokenyard.broker.redis.keys import Keys
from tokenyard.broker.tables import SERIES_KEEP_S, Series

_PAGE = 1000  # points per XRANGE
# stream ids are the server's clock, points carry their gateway's: a read starts this much
# earlier and keeps the points by their own time
_SKEW_S = 60.0


class RedisSeries(Series):
    def __init__(self, conn: RedisConnection, keys: Keys, keep_s: float = SERIES_KEEP_S) -> None:
        self.conn = conn
        self.keys = keys
        self.keep_s = keep_s

    async def append(self, source: str, at: float, value: bytes) -> None:
        # exact MINID: each append trims the few points that just lapsed (`~` would keep
        # them until a whole node of 100 had)
        oldest = int((at - self.keep_s) * 1000)
        await self.conn.one(
            (
                "XADD",
                self.keys.series(),
                "MINID",
                oldest,
                "*",
                "s",
                source,
                "t",
                repr(at),
                "v",
                value,
            )
        )

    async def since(self, at: float) -> list[tuple[str, float, bytes]]:
        start = f"{max(0, int((at - _SKEW_S) * 1000))}-0"
        found: list[tuple[str, float, bytes]] = []
        while True:
            rows: list[tuple[bytes, dict[bytes, bytes]]] = await self.conn.parsed(
                "XRANGE", self.keys.series(), start, "+", "COUNT", _PAGE
            )
            for _, fields in rows:
                t = float(fields[b"t"])
                if t > at:
                    found.append((text(fields[b"s"]), t, bytes(fields[b"v"])))
            if len(rows) < _PAGE:
                return found
            start = f"({text(rows[-1][0])}"
