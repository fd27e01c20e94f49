"""The dashboard's recorded series on NATS: one stream of every gateway's points whose
retention is by age (`max_age`), read by direct gets from the first message stored at the
time asked for."""

from __future__ import annotations

import msgspec

from tokenyard.broker.nats.connection import NatsConnection, sent, trail
from tokenyard.broker.nats.names import Names
from tokenyard.broker.tables import SERIES_KEEP_S, Series
from tokenyard.messages import decode, encode

_PAGE = 256  # points per batched direct get
# the server stamps messages by its clock, points carry their gateway's: a read starts this
# much earlier and keeps the points by their own time
_SKEW_S = 60.0


class _Stored(msgspec.Struct, array_like=True, frozen=True):
    source: str
    at: float
    value: bytes


class NatsSeries(Series):
    def __init__(self, conn: NatsConnection, names: Names, keep_s: float = SERIES_KEEP_S) -> None:
        self.conn = conn
        self.names = names
        self.keep_s = keep_s

    async def _stream(self) -> str:
        names = self.names
        return await self.conn.stream(
            trail(names.series.stream, names.series.subject, max_age=self.keep_s)
        )

    async def append(self, source: str, at: float, value: bytes) -> None:
        stream = await self._stream()
        js = await self.conn.js()
        data = encode(_Stored(source, at, value))
        await sent(js.publish(self.names.series.subject, data, stream=stream))

    async def since(self, at: float) -> list[tuple[str, float, bytes]]:
        stream = await self._stream()
        after = await self._before(stream, at - _SKEW_S)
        if after is None:
            return []
        found: list[tuple[str, float, bytes]] = []
        while True:
            rows = await self.conn.get_batch(stream, self.names.series.subject, after, _PAGE)
            for _, data, _ in rows:
                point = decode(data, _Stored)
                if point.at > at:
                    found.append((point.source, point.at, point.value))
            if len(rows) < _PAGE:
                return found
            after = rows[-1][0]

    async def _before(self, stream: str, at: float) -> int | None:
        """The sequence before the first point stored at or after `at`; None: there is none."""
        if at <= 0:
            return 0
        first = await self.conn.first_at(stream, at)
        return None if first is None else first - 1
