"""Every caller's follow of a job's events, served by shared multiplexed blocking reads."""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field

from tokenyard.broker import core
from tokenyard.errors import BrokerUnavailable
from tokenyard.messages import Finished, JobEvent

Events = list[tuple[str, JobEvent]]  # (event id, event), in stream order


def event_order(event_id: str) -> tuple[int, int]:
    """Stream ids compare as (milliseconds, sequence)."""
    ms, _, seq = event_id.partition("-")
    return int(ms), int(seq or 0)


@dataclass(eq=False)
class Follow:
    """One caller's place in one job's event stream; the hub fills it, the caller drains it.

    A follow without `tokens` is woken only by the job's Finished event; its token events are
    handed to `on_tokens` (a count) as they are read, without waking the caller.
    """

    job_id: str
    model: str
    cursor: str  # the last event id delivered (at first: the one to read after)
    _: KW_ONLY
    tokens: bool = True
    on_tokens: Callable[[int], None] | None = None
    ended: bool = field(default=False, init=False)  # its Finished event was read, or it left
    # what the hub delivered and the caller has not taken, and a future the caller waits on
    # while there is none: a queue's get() would cost wait_for a task per wait
    _ready: Events = field(default_factory=list, init=False)
    _error: BaseException | None = field(default=None, init=False)
    _waiter: asyncio.Future[None] | None = field(default=None, init=False)

    def _deliver(self, events: Events) -> None:
        floor = event_order(self.cursor)
        fresh = [(eid, e) for eid, e in events if event_order(eid) > floor]
        if not fresh:
            return
        self.cursor = fresh[-1][0]
        if isinstance(fresh[-1][1], Finished):
            self.ended = True
        if not self.tokens:
            if self.on_tokens is not None:
                for _, event in fresh:
                    if not isinstance(event, Finished):
                        self.on_tokens(len(event.token_ids))
            fresh = [(eid, e) for eid, e in fresh if isinstance(e, Finished)]
            if not fresh:
                return
        self._ready += fresh
        self._wake()

    def _fail(self, error: BaseException) -> None:
        self.ended = True
        self._error = error
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def next(self, timeout_s: float) -> Events:
        """The events read since the last call; [] when none came within `timeout_s`. An error
        the hub met is raised once the events read before it are taken."""
        if not self._ready and self._error is None:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await asyncio.wait_for(self._waiter, timeout_s)  # a future: no task, one timer
            except TimeoutError:
                return []
            finally:
                self._waiter = None
        if self._ready:
            ready, self._ready = self._ready, []
            return ready
        assert self._error is not None
        raise self._error


class EventHub:
    """Reads the event streams of every follow of this gateway, one XREAD for many jobs.

    All followed jobs of a model (one Redis Cluster slot) share one blocking read. A follow that
    arrives while that read blocks gets a read of its own at once, so it never waits out another
    job's silence; when reads return, their follows merge back into one. At most `max_reads` per
    model are in flight, each holding one broker connection.
    """

    def __init__(self, queue: core.Events, block_s: float, max_reads: int) -> None:
        self.queue = queue
        self.block_s = block_s
        self.max_reads = max(1, max_reads)
        self.reads = 0  # blocking reads issued, for tests and benchmarks
        self._waiting: dict[str, list[Follow]] = defaultdict(list)
        self._in_flight: dict[str, int] = defaultdict(int)
        self._tasks: set[asyncio.Task[None]] = set()
        self._follows: set[Follow] = set()
        self._closed = False

    def follow(
        self,
        job_id: str,
        model: str,
        after: str = "0",
        *,
        tokens: bool = True,
        on_tokens: Callable[[int], None] | None = None,
    ) -> Follow:
        """Start following a job's events after `after`; `leave` it when done."""
        follow = Follow(job_id, model, after, tokens=tokens, on_tokens=on_tokens)
        if self._closed:
            follow._fail(BrokerUnavailable("the gateway is shutting down"))
            return follow
        self._follows.add(follow)
        self._waiting[model].append(follow)
        self._start(model)
        return follow

    def leave(self, follow: Follow) -> None:
        # a read in flight still names its stream; what it brings back for it is dropped
        follow.ended = True
        self._follows.discard(follow)

    def _start(self, model: str) -> None:
        waiting = [f for f in self._waiting.pop(model, ()) if not f.ended]
        if not waiting or self._closed:
            return
        if self._in_flight[model] >= self.max_reads:
            self._waiting[model] = waiting
            return
        self._in_flight[model] += 1
        task = asyncio.create_task(self._read(model, waiting), name="event-hub")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _read(self, model: str, group: list[Follow]) -> None:
        try:
            cursors: dict[str, str] = {}
            for f in group:
                known = cursors.get(f.job_id)
                if known is None or event_order(f.cursor) < event_order(known):
                    cursors[f.job_id] = f.cursor
            self.reads += 1
            try:
                found = await self.queue.read_events_many(cursors, block_s=self.block_s)
            except Exception as exc:
                for f in group:
                    if not f.ended:
                        f._fail(exc)
                return
            by_job: dict[str, Events] = defaultdict(list)
            for job_id, event_id, event in found:
                by_job[job_id].append((event_id, event))
            again = self._waiting[model]
            for f in group:
                if f.ended:
                    continue
                events = by_job.get(f.job_id)
                if events:
                    f._deliver(events)
                if not f.ended:
                    again.append(f)
        finally:
            self._in_flight[model] -= 1
            self._start(model)

    async def close(self) -> None:
        """Stop every read (at shutdown); callers still following hear the broker is gone, so a
        stream's client knows to resume elsewhere."""
        self._closed = True
        self._waiting.clear()
        for follow in self._follows:
            if not follow.ended:
                follow._fail(BrokerUnavailable("the gateway is shutting down"))
        self._follows.clear()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task
