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
from dataclasses import dataclass, field
from typing import Any

import msgspec

from tokenyard.broker import is_job_id
from tokenyard.errors import InvalidRequest, NotFound
from tokenyard.gateway.auth import Tenant
from tokenyard.gateway.live import JobGone, LiveCall
from tokenyard.gateway.responses_api.wire import job_id_of
from tokenyard.gateway.state import GatewayState
from tokenyard.logs import job_fields
from tokenyard.messages import (
    ConversationPart,
    JobRecord,
    JobResult,
    JobStatus,
    StoredResponse,
    Turn,
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


# parts walked back at most: the part past it holds its whole conversation again (a walk of
# reads one after another, so the bound is on latency; a chain of n links stores n parts and
# n / MAX_CHAIN whole conversations)
MAX_CHAIN = 100


@dataclass
class Chain:
    """How a new response continues a stored one: the conversation its job is given before its
    own input, and the part it stores (`prefix`, then its input, after the part `previous`)."""

    turns: list[Turn]
    previous: str | None
    prefix: list[Turn]
    depth: int
    walked: list[tuple[str, ConversationPart]] = field(default_factory=list)


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

    async def chain(self, earlier: StoredResponse, output: list[Turn]) -> Chain:
        """The conversation through `earlier` and its `output`, read from its parts (at most
        MAX_CHAIN, one after another); a part that lapsed is 400, as OpenAI answers a
        `previous_response_id` it no longer has."""
        if not earlier.chained:  # stored before parts: its context is all of it
            turns = [*earlier.context, *output]
            return Chain(turns, None, turns, 1)
        walked: list[tuple[str, ConversationPart]] = []
        at: str | None = earlier.id
        while at is not None and len(walked) < MAX_CHAIN:
            raw = await self.table.part(at)
            if raw is None:
                raise InvalidRequest(
                    f"The conversation before response '{earlier.id}' is no longer stored",
                    param="previous_response_id",
                )
            part = decode(raw, ConversationPart)
            walked.append((at, part))
            at = part.previous
        turns = [t for _, part in reversed(walked) for t in part.turns] + output
        depth = walked[0][1].depth + 1
        if at is not None or depth > MAX_CHAIN:  # its part starts the walk again
            return Chain(turns, None, turns, 1)
        return Chain(turns, earlier.id, output, depth, walked)

    async def create(self, stored: StoredResponse, chain: Chain | None = None) -> None:
        """Store a new response (pending) and its part of the conversation, and keep the parts
        it refers back to at least as long as it."""
        if not stored.store:
            return
        left = self._left_s(stored)
        now = time.time()
        previous, depth = (None, 1) if chain is None else (chain.previous, chain.depth)
        part = ConversationPart(
            previous=previous, turns=stored.context, depth=depth, kept_until=now + left
        )
        await self.table.put_part(stored.id, encode(part), left)
        if chain is not None:
            await self._keep_parts(chain, now + left, now)
        await self.table.put(stored.id, encode(stored), left, now + self.recheck_s)

    async def _keep_parts(self, chain: Chain, until: float, now: float) -> None:
        """The parts a new one refers back to, kept until `until`, and its predecessor's marked
        continued. A part is rewritten only when it would lapse first, and then kept half a
        retention longer, so each is rewritten about once per half retention of the chain's
        use, not once per link."""
        writes = []
        for i, (response_id, part) in enumerate(chain.walked):
            first = i == 0 and not part.continued
            if part.kept_until >= until and not first:
                continue
            kept = msgspec.structs.replace(
                part,
                kept_until=max(part.kept_until, until + self.ttl_s / 2),
                continued=part.continued or i == 0,
            )
            writes.append(self.table.put_part(response_id, encode(kept), kept.kept_until - now))
        await asyncio.gather(*writes)

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
        """Delete the record; its part too, unless a response was chained after it (that one's
        conversation needs it; it lapses then)."""
        await self.table.delete(stored.id)
        raw = await self.table.part(stored.id)
        if raw is not None and not decode(raw, ConversationPart).continued:
            await self.table.delete_part(stored.id)

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
