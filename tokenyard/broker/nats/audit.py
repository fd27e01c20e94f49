"""The audit trail of the NATS backend: a bounded stream of messages each holding the entries
one write gathered (a list); a message's sequence and a place in it are the read cursor."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from tokenyard.broker import audit
from tokenyard.broker.audit import AuditEntry, AuditSink, Mirrored
from tokenyard.broker.nats.connection import NatsConnection, trail
from tokenyard.broker.nats.names import Names
from tokenyard.broker.tables import Audit, AuditQuery
from tokenyard.messages import decode, encode

log = logging.getLogger(__name__)

# how long `append_soon` gathers entries before writing them as one message: a stored message
# and its answer per entry cost the server and both clients more than the entry itself
LINGER_S = 0.01
MOST_PER_MESSAGE = 512  # entries in one message at most
# The bound: `max_len` messages, and as many bytes as `max_len` entries of this size (an entry
# is 0.15-0.3 kB), so the trail keeps about `max_len` entries (up to twice as many small
# ones) however they were gathered; a message holds a quarter of the bound at most.
ENTRY_BYTES = 512


class NatsAudit(Audit, Mirrored):
    """The audit trail: one stream, limits retention at `max_len` messages (0: off); the
    stream sequence is the read cursor. With a sink, each entry the stream took goes there
    too (the Kafka audit log)."""

    def __init__(self, conn: NatsConnection, names: Names, max_len: int) -> None:
        self.conn = conn
        self.names = names
        self.max_len = max_len
        self.sink: AuditSink | None = None
        self._writing: set[asyncio.Task[None]] = set()
        self._gathered: list[AuditEntry] = []  # entries `append_soon` has not written yet
        self._linger: asyncio.TimerHandle | None = None
        self._made = ""  # the stream's name, once made

    def mirror_to(self, sink: AuditSink) -> None:
        self.sink = sink

    async def flush_mirror(self) -> None:
        await self.flush()

    def append_soon(self, entries: Sequence[AuditEntry]) -> None:
        """`append` off the caller's path (a job's state change never waits on its audit),
        gathered for LINGER_S with other calls' entries into one message; this process's reads
        of the trail write what is gathered and wait for what it is still writing."""
        if self.max_len <= 0 or not entries:
            return
        self._gathered.extend(entries)
        if self._linger is None:
            self._linger = asyncio.get_running_loop().call_later(LINGER_S, self._write_gathered)

    def _write_gathered(self) -> None:
        self._linger = None
        gathered, self._gathered = self._gathered, []
        if gathered:
            task = asyncio.create_task(self.append(gathered))
            self._writing.add(task)
            task.add_done_callback(self._writing.discard)

    async def flush(self) -> None:
        """Write what is gathered, and wait for the entries this process is still writing."""
        if self._linger is not None:
            self._linger.cancel()
            self._write_gathered()
        if self._writing:
            await asyncio.gather(*list(self._writing), return_exceptions=True)

    async def _stream(self) -> str:
        if not self._made:
            self._made = await self._make_stream()
        return self._made

    async def _make_stream(self) -> str:
        names = self.names
        return await self.conn.stream(
            trail(
                names.audit.stream,
                names.audit.subject,
                max_msgs=self.max_len,
                max_bytes=self.max_len * ENTRY_BYTES,
            )
        )

    async def append(self, entries: Sequence[AuditEntry]) -> None:
        """Write `entries` (nothing while the trail is off), several to a message; a message
        that fails is logged, the state changes it records stand."""
        if self.max_len <= 0 or not entries:
            return
        await self._stream()
        subject = self.names.audit.subject
        most = min(MOST_PER_MESSAGE, max(1, self.max_len // 4))
        parts = [entries[k : k + most] for k in range(0, len(entries), most)]
        acks = await asyncio.gather(
            *(self.conn.publish_acked(subject, encode(list(part))) for part in parts),
            return_exceptions=True,
        )
        stood: list[AuditEntry] = []
        for part, ack in zip(parts, acks, strict=True):
            if isinstance(ack, BaseException):
                log.error("audit entries of %d jobs not written: %s", len(part), ack)
            else:
                stood += part
        if self.sink is not None and stood:
            self.sink.offer(stood)

    async def read_audit(self, query: AuditQuery) -> tuple[str | None, list[AuditEntry]]:
        since, tenant, model, cursor, count = query
        if self.max_len <= 0:
            return None, []
        await self.flush()
        stream = await self._stream()
        partial, skip = 0, 0  # a message the cursor read the first `skip` entries of
        if cursor:
            seq, _, place = cursor.partition("-")
            partial, skip = (int(seq), int(place)) if place else (0, 0)
            after = int(seq) - 1 if place else int(seq)
        else:
            # the server's stamps start the range (a second early for clock skew); the
            # entries' own times are filtered exactly
            first = await self._first_at(stream, since - 1.0)
            if first is None:
                return None, []
            after = first - 1
        # `count` messages hold at least `count` entries
        rows = await self.conn.get_batch(stream, self.names.audit.subject, after, count)
        read = [
            (seq, place, entry)
            for seq, data, _ in rows
            for place, entry in enumerate(_entries(data))
            if seq != partial or place >= skip
        ][:count]
        found = [e for _, _, e in read if audit.matches(e, since, tenant, model)]
        return (_cursor_after(read, rows) if len(read) == count else None), found

    async def _first_at(self, stream: str, at: float) -> int | None:
        """The sequence of the first entry the server stored at or after `at`."""
        return 1 if at <= 0 else await self.conn.first_at(stream, at)


_ENTRIES: Any = list[AuditEntry] | AuditEntry  # an older trail's message holds one entry


def _entries(data: bytes) -> list[AuditEntry]:
    found = decode(data, _ENTRIES)
    return found if isinstance(found, list) else [found]


def _cursor_after(
    read: Sequence[tuple[int, int, AuditEntry]], rows: Sequence[tuple[int, bytes, Any]]
) -> str:
    """The cursor past the last entry read: its message's sequence when the message was read
    to its end, else `<sequence>-<entries of it read>`."""
    seq, place, _ = read[-1]
    whole = next(len(_entries(data)) for s, data, _ in rows if s == seq)
    return str(seq) if place + 1 == whole else f"{seq}-{place + 1}"
