"""Stored responses: kept in the broker's `StoredResponses` table beside their jobs.

A stored response is written (pending) when its job is entered, and its job's result is copied
into it by the first gateway that sees the job end: the caller of a sync or streaming response,
the watcher of a background one on the gateway that created it, any later read, or, when that
gateway died, any gateway's sweep of the pending ones that are due: each is due a sweep period
after it was stored, then again a period after each look that found its job still running, and a
sweep reads the due ones in order from the table's due-time index, however many are pending.
The job's own record lapses after `record_ttl_s`, the stored response after `response_ttl_s`
from creation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from typing import Any

from tokenyard.broker import is_job_id
from tokenyard.errors import NotFound
from tokenyard.gateway.auth import Tenant
from tokenyard.gateway.live import JobGone, LiveCall
from tokenyard.gateway.responses_api.wire import job_id_of
from tokenyard.gateway.state import GatewayState
from tokenyard.logs import job_fields
from tokenyard.messages import (
    JobRecord,
    JobResult,
    JobStatus,
    StoredResponse,
    decode,
    encode,
)

log = logging.getLogger(__name__)
SWEEP_BATCH = 256  # due stored responses looked at per round of a sweep
RECHECK_S = 30.0  # a pending response is looked at this long after it is stored or deferred
_LAPSED = JobResult(
    status=JobStatus.DEAD,
    error="the job's record lapsed before a gateway stored its result (record_ttl_s)",
)


def not_found(raw_id: str, param: str | None = None) -> NotFound:
    return NotFound(f"No response with id '{raw_id}' found", param=param, code="response_not_found")


class ResponseService:
    """Keeps stored responses and the watchers that complete background ones."""

    def __init__(self, state: GatewayState) -> None:
        self.state = state
        self.table = state.backend.stored_responses
        self.ttl_s = state.backend.settings.response_ttl_s
        # the creating gateway's watcher settles a background response when its job ends; a
        # sweep looks at one only once it is due: this long after it was stored or last looked
        # at (the sweep's period, so an orphan waits at most about two periods)
        self.recheck_s = state.settings.responses_sweep_s or RECHECK_S
        self._tasks: set[asyncio.Task[None]] = set()
        if state.settings.responses_sweep_s > 0:
            self._spawn(self._sweeping(state.settings.responses_sweep_s), "response-sweep")

    def _spawn(self, work: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _left_s(self, stored: StoredResponse) -> float:
        # retention counts from creation, however often the record is rewritten
        return max(1.0, stored.created_at + self.ttl_s - time.time())

    async def create(self, stored: StoredResponse) -> None:
        if stored.store:
            due = time.time() + self.recheck_s
            await self.table.put(stored.id, encode(stored), self._left_s(stored), due)

    async def get(self, raw_id: str, tenant: Tenant, param: str | None = None) -> StoredResponse:
        """The tenant's stored response; another tenant's is as absent as a missing one."""
        job_id = job_id_of(raw_id)
        if job_id is None or not is_job_id(job_id):
            raise not_found(raw_id, param)
        raw = await self.table.get(raw_id)
        if raw is None:
            raise not_found(raw_id, param)
        stored = decode(raw, StoredResponse)
        if stored.tenant != tenant.name:
            raise not_found(raw_id, param)
        return stored

    async def delete(self, stored: StoredResponse) -> None:
        await self.table.delete(stored.id)

    async def finish(self, stored: StoredResponse, result: JobResult) -> StoredResponse:
        """Copy the job's result into the stored response (once; a deleted one stays gone)."""
        if stored.result is not None:
            return stored
        stored.result = result
        stored.completed_at = time.time()
        if stored.store:
            await self.table.replace(stored.id, encode(stored), self._left_s(stored))
            await self.table.settle([stored.id])
        return stored

    async def current(self, stored: StoredResponse) -> tuple[StoredResponse, JobStatus | None]:
        """The stored response with its job's result when the job has ended, else the job's
        state."""
        if stored.result is not None:
            return stored, None
        record: JobRecord | None = await self.state.backend.queue.record(stored.job_id)
        if record is None:
            # entered before the response was stored, so its record lapsed (record_ttl_s)
            # with no gateway having seen it end: its outcome is lost, and says so
            return await self.finish(stored, _LAPSED), None
        if record.status.terminal and record.result is not None:
            return await self.finish(stored, record.result), record.status
        return stored, record.status

    def watch(self, stored: StoredResponse) -> None:
        """Follow a background response's job to its end and store its result."""
        self._spawn(self._watch(stored), "response-watch")

    def keep(self, stored: StoredResponse, result: JobResult) -> None:
        """Store a result a live call saw, without holding the call up."""
        self._spawn(self._keep(stored, result), "response-keep")

    async def sweep(self, now: float | None = None) -> int:
        """Look at every pending stored response due by `now`, the earliest due first, in
        rounds of SWEEP_BATCH: copy in the result of those whose job ended, and defer the
        others by `recheck_s`; returns how many were settled."""
        now = time.time() if now is None else now
        settled = 0
        seen: set[str] = set()
        while True:
            ids = await self.table.due(now, SWEEP_BATCH)
            fresh = [i for i in ids if i not in seen]
            if not fresh:  # none due, or only what this sweep could not move (a lost write)
                return settled
            seen.update(fresh)
            settled += await self._look(fresh, now)
            if len(ids) < SWEEP_BATCH:
                return settled

    async def _look(self, ids: list[str], now: float) -> int:
        """One round of a sweep (each job's record read once, one round trip for all)."""
        found = await asyncio.gather(*(self.table.get(i) for i in ids))
        gone = [i for i, raw in zip(ids, found, strict=True) if raw is None]
        open_ = [decode(raw, StoredResponse) for raw in found if raw is not None]
        done = [s.id for s in open_ if s.result is not None]
        await self.table.settle(gone + done)
        waiting = [s for s in open_ if s.result is None]
        records = await self.state.backend.queue.records([s.job_id for s in waiting])
        ended: list[tuple[StoredResponse, JobResult]] = []
        later: list[str] = []
        for stored, record in zip(waiting, records, strict=True):
            if record is None:
                ended.append((stored, _LAPSED))
            elif record.status.terminal and record.result is not None:
                ended.append((stored, record.result))
            else:
                later.append(stored.id)
        await asyncio.gather(*(self.finish(s, r) for s, r in ended))
        await self.table.defer(later, now + self.recheck_s)
        return len(gone) + len(done) + len(ended)

    async def _sweeping(self, every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)
            try:
                await self.sweep()
            except Exception:
                log.warning("sweeping stored responses failed", exc_info=True)

    async def _keep(self, stored: StoredResponse, result: JobResult) -> None:
        try:
            await self.finish(stored, result)
        except Exception:
            # a later read copies it from the job's record
            log.warning("storing response %s failed", stored.id, exc_info=True)

    async def _watch(self, stored: StoredResponse) -> None:
        call = LiveCall(self.state, stored.job_id, stored.model)
        try:
            result = await call.wait()
        except JobGone:
            return
        except Exception:
            # the gateway is closing or the broker is away: a later read finishes it
            log.info("watching response %s stopped", stored.id, extra=job_fields(stored.job_id))
            return
        await self._keep(stored, result)

    async def wait(self, stored: StoredResponse, timeout_s: float) -> StoredResponse:
        """The stored response once its job ended (within `timeout_s`), e.g. after a cancel."""
        call = LiveCall(self.state, stored.job_id, stored.model)
        with contextlib.suppress(TimeoutError, JobGone):
            async with asyncio.timeout(timeout_s):
                return await self.finish(stored, await call.wait())
        return stored

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task
