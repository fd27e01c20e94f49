"""A job's endings by the broker itself (cancel, expiry, dead letter) and the records that follow
a Finished event: every ending writes its Finished before its record, so a Finished whose record
was not written is copied into it by whoever meets it (`mend`).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from tokenyard.broker import machine
from tokenyard.broker.core import CancelOutcome
from tokenyard.broker.machine import Bury, Count, Step
from tokenyard.broker.nats.names import Names
from tokenyard.broker.nats.records import StoredJob
from tokenyard.broker.nats.store import Fenced, Part
from tokenyard.messages import Finished, JobResult, JobStatus, encode


class Endings(Part):
    """Endings and cancellation, carried out as the job state machine's steps."""

    async def end(
        self,
        job: StoredJob,
        revision: int,
        result: JobResult,
        reason: str | None = None,
        error: str | None = None,
        expect: int | None = None,
    ) -> bool:
        """A terminal write by the broker itself (cancel, expiry, dead letter): its Finished
        event after the events' last (`expect`, a holder's own; else read here), then the
        record, its lane message gone, quota and audit. False when the job moved meanwhile (an
        event came first, or it had ended: its record now follows its Finished)."""
        job_id = job.spec.id
        if expect is None:
            expect, ended = await self.store.last_finished(job_id)
            if ended is not None:
                await self.mend(job, revision, ended, None)
                return False
        # an id of this ending alone: two enders must never pass for one another
        msg_id = f"{job_id}.e{uuid.uuid4().hex[:16]}"
        finished = encode(Finished(result=result))
        try:
            await self.store.publish_event(job_id, finished, expect, msg_id=msg_id)
        except Fenced:
            return False
        turned = await self.follow(job, revision, result)
        await self.store.drop_message(job)
        if reason is not None:
            await self.store.dead_letter_entry(job, reason, error)
        if turned or not job.spec.quota:  # without quota: whoever wrote the Finished settles
            await self.store.settle([(job.spec, result)])
        return True

    async def ended(
        self, job: StoredJob, revision: int, step: Step, expect: int | None = None
    ) -> bool:
        """Carry out a step of the machine that ends the job (`_end`), with its dead letter
        and counters."""
        job.take_on(step.state)
        assert step.state.result is not None
        letter = next((e for e in step.effects if isinstance(e, Bury)), None)
        reason, error = (None, None) if letter is None else (letter.reason, letter.error)
        if not await self.end(job, revision, step.state.result, reason, error, expect):
            return False
        for effect in step.effects:
            if isinstance(effect, Count) and effect.name != "dead":  # dead: the stream counts
                await self.store.count(job.spec.model, effect.name)
        if step.state.cancel:
            await self.store.mark(Names.cancels(job.spec.model), job.spec.id, False)
        return True

    async def follow(self, job: StoredJob, revision: int, result: JobResult) -> bool:
        """Make the record terminal with `result`, whose Finished is in (so no one appends or
        takes the job any more), whatever it says meanwhile; whether this write did it (the one
        that does settles the job)."""
        for _ in range(64):
            job.status = result.status
            job.result = result
            job.finished_at = self.clock()
            if await self.store.cas(job, revision) is not None:
                return True
            found = await self.store.get(job.spec.id)
            if found is None or found[0].terminal:
                return False
            job, revision = found
        return False

    async def mend(
        self,
        job: StoredJob,
        revision: int,
        result: JobResult,
        reply: str | None,
        at: float | None = None,
    ) -> None:
        """The record of a job whose Finished is in but whose writer did not write the record
        (a completion that ends a job by its Finished alone, or a writer that died or met a
        failover in between): terminal now, not run again. `reply`: the lane message a claim
        holds (None: a reader or a broker-side ending met it); `at`: when the Finished was
        stored."""
        job.status = result.status
        job.result = result
        job.finished_at = self.clock() if at is None else at  # when its Finished was stored
        if await self.store.cas(job, revision) is None:
            if reply:
                # changed meanwhile: the redelivery looks again
                await self.store.ack(reply, b"-NAK")
            return
        if reply:
            await self.store.ack(reply)
        if job.cancel:
            await self.store.mark(Names.cancels(job.spec.model), job.spec.id, False)
        if job.spec.quota:  # without quota the Finished's writer settled it (its audit entry)
            await self.store.settle([(job.spec, result)])

    async def cancel(self, job_id: str) -> CancelOutcome:
        return await self._cancel(job_id, 0)

    async def leave(self, job_id: str, followers: int = 1) -> CancelOutcome:
        return await self._cancel(job_id, max(1, followers))

    async def _cancel(self, job_id: str, leaving: int) -> CancelOutcome:
        for _ in range(16):
            found = await self.store.get(job_id)
            if found is None:
                return CancelOutcome.NOT_FOUND
            job, revision = found
            if job.status is JobStatus.RUNNING:
                # a completion may have ended it by its Finished alone (leases.py)
                _, ended, at = await self.store.ending(job_id)
                if ended is not None:
                    await self.mend(job, revision, ended, None, at)
                    return CancelOutcome.ALREADY_FINISHED
            step = machine.cancel(job.state(), self.clock(), leaving)
            if not isinstance(step, Step):
                return CancelOutcome.ALREADY_FINISHED
            if step.ended:
                if await self.ended(job, revision, step):
                    await self.store.mark(Names.delayed(job.spec.model), job_id, False)
                    return CancelOutcome.CANCELLED
                continue
            job.take_on(step.state)
            if await self.store.cas(job, revision) is None:
                continue
            if not step.effects:
                return CancelOutcome.FOLLOWED
            await self.store.mark(Names.cancels(job.spec.model), job_id, True)
            return CancelOutcome.SIGNALLED
        return CancelOutcome.NOT_FOUND

    async def cancelled(self, model: str, job_ids: Sequence[str]) -> set[str]:
        if not job_ids:
            return set()
        return await self.store.marked(Names.cancels(model)) & set(job_ids)
