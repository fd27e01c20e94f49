"""The audit trail of the NATS backend: a bounded stream, its sequence the read cursor."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from tokenyard.broker import audit
from tokenyard.broker.audit import AuditEntry, AuditSink, Mirrored
from tokenyard.broker.nats.connection import NatsConnection, trail
from tokenyard.broker.nats.names import Names
from tokenyard.broker.tables import Audit, AuditQuery
from tokenyard.messages import decode, encode

log = logging.getLogger(__name__)


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
        self._made = ""  # the stream's name, once made

    def mirror_to(self, sink: AuditSink) -> None:
        self.sink = sink

    async def flush_mirror(self) -> None:
        await self.flush()

    def append_soon(self, entries: Sequence[AuditEntry]) -> None:
        """`append` off the caller's path (a job's state change never waits on its audit);
        this process's reads of the trail wait for what it is still writing."""
        if self.max_len <= 0 or not entries:
            return
        task = asyncio.create_task(self.append(entries))
        self._writing.add(task)
        task.add_done_callback(self._writing.discard)

    async def flush(self) -> None:
        """Wait for the entries this process is still writing."""
        if self._writing:
            await asyncio.gather(*list(self._writing), return_exceptions=True)

    async def _stream(self) -> str:
        if not self._made:
            self._made = await self._make_stream()
        return self._made

    async def _make_stream(self) -> str:
        names = self.names
        return await self.conn.stream(
            trail(names.audit_stream, names.audit_subject, max_msgs=self.max_len)
        )

    async def append(self, entries: Sequence[AuditEntry]) -> None:
        """Write `entries` (nothing while the trail is off); one that fails is logged, the
        state change it records stands."""
        if self.max_len <= 0 or not entries:
            return
        await self._stream()
        subject = self.names.audit_subject

        async def one(entry: AuditEntry) -> int:
            return await self.conn.publish_acked(subject, encode(entry))

        acks = await asyncio.gather(*(one(e) for e in entries), return_exceptions=True)
        for entry, ack in zip(entries, acks, strict=True):
            if isinstance(ack, BaseException):
                log.error("audit entry of job %s not written: %s", entry.job_id, ack)
        if self.sink is not None:
            stood = [
                e for e, a in zip(entries, acks, strict=True) if not isinstance(a, BaseException)
            ]
            if stood:
                self.sink.offer(stood)

    async def read_audit(self, query: AuditQuery) -> tuple[str | None, list[AuditEntry]]:
        since, tenant, model, cursor, count = query
        if self.max_len <= 0:
            return None, []
        await self.flush()
        stream = await self._stream()
        if cursor:
            after = int(cursor)
        else:
            # the server's stamps start the range (a second early for clock skew); the
            # entries' own times are filtered exactly
            first = await self._first_at(stream, since - 1.0)
            if first is None:
                return None, []
            after = first - 1
        rows = await self.conn.get_batch(stream, self.names.audit_subject, after, count)
        found = [decode(data, AuditEntry) for _, data, _ in rows]
        found = [e for e in found if audit.matches(e, since, tenant, model)]
        return (str(rows[-1][0]) if len(rows) == count else None), found

    async def _first_at(self, stream: str, at: float) -> int | None:
        """The sequence of the first entry the server stored at or after `at`."""
        return 1 if at <= 0 else await self.conn.first_at(stream, at)
