"""A job's life as one state machine: every transition a backend applies, written once.

Each transition is a pure function from (state, what happened, now) to a `Step`: the state
after and the effects a backend carries out (acknowledge the lane message, redeliver it after
a delay, dead-letter it, append the Finished event, ...), or a `Refused` (the caller does not
hold the job, the job ended already, or its holder's lease still runs). Backends keep their
own storage and round trips: NATS applies a step inside its compare-and-set on the job's
record; the Valkey and RabbitMQ scripts take the same steps in Lua, one round trip each
(lua/lib/ends.lua holds their one terminal write), and tests/integration/test_broker_machine.py
holds every backend to this module: random operation sequences end in the states it predicts.

A job a client asked to cancel while it ran ends cancelled whenever its holder lets go of it
(fails, releases, dies), rather than running again. No I/O and no clock of its own: `now` is
passed in.
"""

from __future__ import annotations

import enum

import msgspec

from tokenyard.broker.outcomes import cancelled_result, dead_result, expired_result
from tokenyard.config import BrokerSettings
from tokenyard.messages import JobResult, JobStatus


class Reason(enum.StrEnum):
    """Why a job was dead-lettered: the one set every backend writes."""

    LEASE_EXPIRED = "lease_expired"  # its holder never finished it, on every allowed delivery
    FAILED = "failed"  # its engine failed it on every allowed delivery
    # a caller's own reason (`dead_letter(lease, reason)`) is kept as given: bad_input, ...


def lapsed_error(deliveries: int) -> str:
    """The error of a job dead-lettered because no holder finished it."""
    return f"lease expired on each of {deliveries} deliveries"


class Rules(msgspec.Struct, frozen=True):
    """The settings the machine's decisions depend on."""

    lease_s: float = 30.0
    max_deliveries: int = 5
    max_preemptions: int = 3  # times a job may be preempted (then it runs to its end)

    @classmethod
    def of(cls, settings: BrokerSettings) -> Rules:
        """The rules a backend's settings name."""
        return cls(
            lease_s=settings.lease_s,
            max_deliveries=settings.max_deliveries,
            max_preemptions=settings.max_preemptions,
        )


class JobState(msgspec.Struct, kw_only=True):
    """What the machine needs of a job's record (a backend's record holds more)."""

    status: JobStatus = JobStatus.QUEUED
    deliveries: int = 0
    holder: str | None = None  # the consumer holding its lease (running only)
    lease_until: float = 0.0
    deadline: float | None = None
    cancel: bool = False  # a client asked to cancel it while it ran
    followers: int = 1  # live callers following it (collapsed requests join)
    preemptions: int = 0  # times its holder handed it back for higher-priority work
    last_error: str | None = None
    result: JobResult | None = None
    started_at: float | None = None
    finished_at: float | None = None

    @property
    def terminal(self) -> bool:
        return self.status.terminal

    def copy(self) -> JobState:
        return msgspec.structs.replace(self)


# -- effects: what a backend does besides writing the state ---------------------------------
class Ack(msgspec.Struct, frozen=True, tag="ack"):
    """Acknowledge (remove) the lane message the job was delivered by."""


class Redeliver(msgspec.Struct, frozen=True, tag="redeliver"):
    """Deliver the job again after `delay_s` (0: at once)."""

    delay_s: float = 0.0


class Requeue(msgspec.Struct, frozen=True, tag="requeue"):
    """Put the job at the back of its lane again (its holder is gone)."""


class Bury(msgspec.Struct, frozen=True, tag="bury"):
    """Add the job to its model's dead letters (its record ends with `Finish`)."""

    reason: str
    error: str
    deliveries: int


class Finish(msgspec.Struct, frozen=True, tag="finish"):
    """Append the job's Finished event (with its result): the record is terminal."""

    result: JobResult


class SignalCancel(msgspec.Struct, frozen=True, tag="signal_cancel"):
    """Tell the running job's worker to abort it (the cancels set)."""


class Count(msgspec.Struct, frozen=True, tag="count"):
    """Add one to a per-model counter (`expired`, `dead`, `fenced`)."""

    name: str


Effect = Ack | Redeliver | Requeue | Bury | Finish | SignalCancel | Count


class Step(msgspec.Struct, frozen=True):
    """A transition taken: the state after it and what the backend must do."""

    state: JobState
    effects: tuple[Effect, ...] = ()

    @property
    def ended(self) -> bool:
        return any(isinstance(e, Finish) for e in self.effects)


class Refused(enum.StrEnum):
    FENCED = "fenced"  # the caller does not hold the job (its lease was lost)
    FINISHED = "finished"  # the job is terminal already
    NOT_YET = "not_yet"  # delivered while its holder's lease still runs: deliver it later
    SPENT = "spent"  # preempted its maximum number of times already: it runs to its end


Outcome = Step | Refused


def _end(state: JobState, result: JobResult, now: float, *extra: Effect) -> Step:
    after = state.copy()
    after.status = result.status
    after.result = result
    after.finished_at = now
    after.holder = None
    return Step(after, (*extra, Ack(), Finish(result)))


def _held(state: JobState, consumer: str) -> bool:
    return state.status is JobStatus.RUNNING and state.holder == consumer


# -- transitions -----------------------------------------------------------------------------
def take(state: JobState, consumer: str, now: float, rules: Rules) -> Outcome:
    """A lane delivered the job to `consumer`: lease it, or end it (deadline passed, every
    delivery used), or refuse (ended already; its holder's lease still runs)."""
    if state.terminal:
        return Refused.FINISHED
    if state.status is JobStatus.RUNNING and state.lease_until > now:
        return Refused.NOT_YET
    if state.cancel:
        return _end(state, cancelled_result(), now)
    if state.deadline is not None and state.deadline <= now:
        return _end(state, expired_result(), now, Count("expired"))
    if state.deliveries >= rules.max_deliveries:
        return _lapsed_for_good(state, now)
    after = state.copy()
    after.status = JobStatus.RUNNING
    after.deliveries += 1
    after.holder = consumer
    after.lease_until = now + rules.lease_s
    after.started_at = state.started_at or now
    return Step(after)


def renew(state: JobState, consumer: str, now: float, rules: Rules) -> Outcome:
    if not _held(state, consumer):
        return Refused.FENCED
    after = state.copy()
    after.lease_until = now + rules.lease_s
    return Step(after)


def complete(state: JobState, consumer: str, result: JobResult, now: float) -> Outcome:
    """The holder's terminal write; anyone else's is fenced (and counted)."""
    if not _held(state, consumer):
        return Refused.FENCED
    return _end(state, result, now)


def fail(
    state: JobState,
    consumer: str,
    error: str,
    now: float,
    rules: Rules,
    delay_s: float,
    reason: str | None = None,
) -> Outcome:
    """The holder gives a delivery up: retried after `delay_s` while deliveries remain, else
    (or at once, when `reason` names why it can never succeed) dead-lettered."""
    if not _held(state, consumer):
        return Refused.FENCED
    if state.cancel and reason is None:
        return _end(state, cancelled_result(), now)
    if reason is None and state.deliveries < rules.max_deliveries:
        after = state.copy()
        after.status = JobStatus.QUEUED
        after.holder = None
        after.last_error = error
        return Step(after, (Redeliver(delay_s),))
    why = reason or Reason.FAILED
    return _dead(state, why, error, now, f"{why}: {error}")


def release(state: JobState, consumer: str, now: float) -> Outcome:
    """The holder hands the job back unfinished (a drain): at once, the delivery uncharged."""
    if not _held(state, consumer):
        return Refused.FENCED
    if state.cancel:
        return _end(state, cancelled_result(), now)
    after = state.copy()
    after.status = JobStatus.QUEUED
    after.holder = None
    after.deliveries -= 1
    return Step(after, (Redeliver(0.0),))


def preempt(state: JobState, consumer: str, now: float, rules: Rules) -> Outcome:
    """The holder hands the job back for higher-priority work: a release (at once, the
    delivery uncharged, its streamed tokens kept for the next holder), counted, and refused
    once the job was preempted `max_preemptions` times, so no job is preempted forever."""
    if not _held(state, consumer):
        return Refused.FENCED
    if state.preemptions >= rules.max_preemptions and not state.cancel:
        return Refused.SPENT
    step = release(state, consumer, now)
    if isinstance(step, Step) and not step.ended:
        step.state.preemptions += 1
    return step


def lapse(state: JobState, now: float, rules: Rules, holder_alive: bool = True) -> Outcome:
    """The reaper looks at a running job: its lease ran out, or its holder is gone (`holder
    alive` False: its liveness lapsed though the lease runs on). Requeued, or dead-lettered
    on its last allowed delivery."""
    if state.status is not JobStatus.RUNNING:
        return Refused.FINISHED if state.terminal else Refused.NOT_YET
    if holder_alive and state.lease_until > now:
        return Refused.NOT_YET
    if state.cancel:
        return _end(state, cancelled_result(), now)
    if state.deliveries >= rules.max_deliveries:
        return _lapsed_for_good(state, now)
    after = state.copy()
    after.status = JobStatus.QUEUED
    after.holder = None
    return Step(after, (Requeue(),))


def cancel(state: JobState, now: float, leaving: int = 0) -> Outcome:
    """A client cancels (`leaving` 0), or `leaving` followers stop following: a waiting job
    ends cancelled, a running one is signalled; while followers remain it runs on."""
    if state.terminal:
        return Refused.FINISHED
    after = state.copy()
    if leaving:
        after.followers -= leaving
        if after.followers > 0:
            return Step(after)
    if state.status is JobStatus.RUNNING:
        after.cancel = True
        return Step(after, (SignalCancel(),))
    return _end(after, cancelled_result(), now)


def join(state: JobState) -> Outcome:
    """An identical request joins the job in flight (collapse): one more follower."""
    if state.terminal:
        return Refused.FINISHED
    after = state.copy()
    after.followers += 1
    return Step(after)


def _lapsed_for_good(state: JobState, now: float) -> Step:
    error = lapsed_error(state.deliveries)
    return _dead(state, Reason.LEASE_EXPIRED, error, now, error)


def _dead(state: JobState, reason: str, error: str, now: float, message: str) -> Step:
    letter = Bury(reason=reason, error=error, deliveries=state.deliveries)
    step = _end(state, dead_result(message), now, letter, Count("dead"))
    step.state.last_error = error
    return step
