"""Reading a job on NATS: its events (claim markers skipped, a last message read as its tail and
Finished) and its record.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping, Sequence

from nats.aio.msg import Msg

from tokenyard.broker.core import EventReads
from tokenyard.broker.nats.connection import sent
from tokenyard.broker.nats.endings import Endings
from tokenyard.broker.nats.store import MARKER, Part, Store, events_of
from tokenyard.messages import JobEvent, JobRecord, JobStatus

REREAD_S = 0.25  # a blocked read reads again this often even when nothing woke it


class Reads(Part, EventReads):
    """Events and records as readers see them (a job's events: `EventReads.read_events`)."""

    def __init__(self, store: Store, endings: Endings) -> None:
        super().__init__(store)
        self.endings = endings  # the endings every part's steps end jobs through

    async def read_events_many(
        self, cursors: Mapping[str, str], block_s: float = 0.0, count: int = 1000
    ) -> list[tuple[str, str, JobEvent]]:
        if not cursors:
            return []
        stream = await self.store.events_stream()
        if block_s <= 0:
            return await self._read(stream, cursors, count)
        subjects = {self.names.events(j): j for j in cursors}
        nc = await self.conn.client()
        woke = asyncio.Event()

        async def on_event(msg: Msg) -> None:
            # a claim marker is no event for a reader
            if msg.subject in subjects and not (msg.headers and msg.headers.get(MARKER)):
                woke.set()

        # subscribe before reading, so an event appended in between wakes the wait
        subs = [await sent(nc.subscribe(s, cb=on_event)) for s in subjects]
        try:
            give_up = time.monotonic() + block_s
            settle = 0.0
            while True:
                woke.clear()
                found = await self._read(stream, cursors, count)
                left = give_up - time.monotonic()
                if found or left <= 0:
                    return found
                if settle and settle < 0.05:
                    # a core subscriber hears of a message before a direct get can read it back
                    # from the stream: after a wake-up, read again shortly before waiting on
                    await asyncio.sleep(settle)
                    settle *= 2
                    continue
                try:
                    await asyncio.wait_for(woke.wait(), min(left, REREAD_S))
                except TimeoutError:
                    if give_up - time.monotonic() <= 0:
                        return []
                    # a message delivered just before the subscription woke nothing, and may
                    # not have been readable by the read after it: read again
                    continue
                settle = 0.001
        finally:
            for sub in subs:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()

    async def _read(
        self, stream: str, cursors: Mapping[str, str], count: int
    ) -> list[tuple[str, str, JobEvent]]:
        async def one(job_id: str, after: str) -> list[tuple[str, str, JobEvent]]:
            # claim markers take places in a batch but are no events: read on past them. The
            # cursor's own message is read again: a job's last message holds two events, and
            # the cursor may be its first
            out: list[tuple[str, str, JobEvent]] = []
            floor = _cursor(after)
            seq = max(0, floor[0] - 1)
            while len(out) < count:
                want = count - len(out)
                rows = await self.conn.get_batch(stream, self.names.events(job_id), seq, want)
                for n, data, headers in rows:
                    if headers.get(MARKER):
                        continue
                    for part, event in enumerate(events_of(data, headers)):
                        if (n, part) > floor:
                            out.append((job_id, f"{n}-{part}" if part else str(n), event))
                if len(rows) < want:
                    break
                seq = rows[-1][0]
            return out[:count]

        parts = await asyncio.gather(*(one(j, a) for j, a in cursors.items()))
        return [row for part in parts for row in part]

    async def record(self, job_id: str) -> JobRecord | None:
        found = await self.store.get(job_id)
        if found is None:
            return None
        job, revision = found
        if job.status is JobStatus.RUNNING or (not job.terminal and job.deliveries):
            # a completion ends a job by its Finished alone (leases.py), and a holder may have
            # died between its Finished and the record: follow the events
            _, ended, at = await self.store.ending(job_id)
            if ended is not None:
                await self.endings.mend(job, revision, ended, None, at)  # `job` reads as ended
        return job.record()

    async def records(self, job_ids: Sequence[str]) -> list[JobRecord | None]:
        return list(await asyncio.gather(*(self.record(j) for j in job_ids)))


def _cursor(after: str) -> tuple[int, int]:
    """An event id as (stream sequence, place in its message): 'S' the message's first event,
    'S-1' its second (a job's Finished after its tail); '0' or '' reads from the start."""
    seq, _, part = after.partition("-")
    try:
        return max(0, int(seq or 0)), max(0, int(part or 0))
    except ValueError:
        return 0, 0
