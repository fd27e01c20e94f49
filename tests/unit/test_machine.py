"""The job state machine's invariants under any sequence of events (a hypothesis stateful
test): one terminal state that never changes, one Finished per job, fenced holders change
nothing, deliveries bounded, followers counted."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tokenyard.broker import machine
from tokenyard.broker.machine import (
    Ack,
    Bury,
    Finish,
    JobState,
    Redeliver,
    Refused,
    Requeue,
    Rules,
    SignalCancel,
    Step,
)
from tokenyard.messages import FinishReason, JobResult, JobStatus

RULES = Rules(lease_s=10.0, max_deliveries=3, max_preemptions=2)
CONSUMERS = ("a", "b", "c")


def ok(text: str) -> JobResult:
    return JobResult(status=JobStatus.SUCCEEDED, finish_reason=FinishReason.STOP, text=text)


class OneJob(RuleBasedStateMachine):
    """One job, several consumers that may hold stale leases, and a clock that moves."""

    def __init__(self) -> None:
        super().__init__()
        self.state = JobState(deadline=None)
        self.now = 0.0
        self.finishes = 0
        self.ended_as: JobState | None = None
        self.charged = 0  # deliveries taken and not handed back by a release
        self.preempted = 0  # preemptions the machine took

    def apply(self, outcome: machine.Outcome, before: JobState) -> None:
        if isinstance(outcome, Refused):
            return
        assert isinstance(outcome, Step)
        after = outcome.state
        assert before is not after  # a transition never edits the state it was given
        finishes = [e for e in outcome.effects if isinstance(e, Finish)]
        self.finishes += len(finishes)
        if finishes:
            assert after.terminal and finishes[0].result == after.result
            assert any(isinstance(e, Ack) for e in outcome.effects)
            self.ended_as = after
        elif after.terminal:
            raise AssertionError("a terminal state written without its Finished event")
        if any(isinstance(e, Bury) for e in outcome.effects):
            assert after.status is JobStatus.DEAD
        if any(isinstance(e, (Redeliver, Requeue)) for e in outcome.effects):
            assert after.status is JobStatus.QUEUED and after.holder is None
        if any(isinstance(e, SignalCancel) for e in outcome.effects):
            assert after.status is JobStatus.RUNNING and after.cancel
        self.state = after

    @rule(dt=st.floats(min_value=0.0, max_value=15.0))
    def tick(self, dt: float) -> None:
        self.now += dt

    @rule(consumer=st.sampled_from(CONSUMERS))
    def take(self, consumer: str) -> None:
        before = self.state.copy()
        outcome = machine.take(self.state, consumer, self.now, RULES)
        if isinstance(outcome, Step) and outcome.state.status is JobStatus.RUNNING:
            assert outcome.state.deliveries == before.deliveries + 1
            assert outcome.state.holder == consumer
            self.charged += 1
        if before.status is JobStatus.RUNNING and before.lease_until > self.now:
            assert outcome is Refused.NOT_YET  # a live lease is never taken over
        self.apply(outcome, before)

    @rule(consumer=st.sampled_from(CONSUMERS))
    def renew(self, consumer: str) -> None:
        before = self.state.copy()
        outcome = machine.renew(self.state, consumer, self.now, RULES)
        if before.holder != consumer or before.status is not JobStatus.RUNNING:
            assert outcome is Refused.FENCED
        self.apply(outcome, before)

    @rule(consumer=st.sampled_from(CONSUMERS), text=st.text(max_size=3))
    def complete(self, consumer: str, text: str) -> None:
        before = self.state.copy()
        outcome = machine.complete(self.state, consumer, ok(text), self.now)
        if before.holder != consumer or before.status is not JobStatus.RUNNING:
            assert outcome is Refused.FENCED
        self.apply(outcome, before)

    @rule(
        consumer=st.sampled_from(CONSUMERS),
        reason=st.sampled_from([None, "bad_input"]),
        delay=st.floats(min_value=0.0, max_value=5.0),
    )
    def fail(self, consumer: str, reason: str | None, delay: float) -> None:
        before = self.state.copy()
        outcome = machine.fail(self.state, consumer, "boom", self.now, RULES, delay, reason)
        if isinstance(outcome, Step):
            dead = [e for e in outcome.effects if isinstance(e, Bury)]
            at_limit = before.deliveries >= RULES.max_deliveries
            cancelled = before.cancel and reason is None
            assert bool(dead) == (reason is not None or (at_limit and not cancelled))
            if dead:
                assert dead[0].reason == (reason or machine.Reason.FAILED)
        self.apply(outcome, before)

    @rule(consumer=st.sampled_from(CONSUMERS))
    def release(self, consumer: str) -> None:
        before = self.state.copy()
        outcome = machine.release(self.state, consumer, self.now)
        if isinstance(outcome, Step) and not outcome.state.terminal:
            assert outcome.state.deliveries == before.deliveries - 1
            self.charged -= 1
        self.apply(outcome, before)

    @rule(consumer=st.sampled_from(CONSUMERS))
    def preempt(self, consumer: str) -> None:
        before = self.state.copy()
        outcome = machine.preempt(self.state, consumer, self.now, RULES)
        if before.holder != consumer or before.status is not JobStatus.RUNNING:
            assert outcome is Refused.FENCED
        elif before.preemptions >= RULES.max_preemptions and not before.cancel:
            assert outcome is Refused.SPENT  # bounded: it runs to its end from here
        elif isinstance(outcome, Step) and not outcome.state.terminal:
            # a release that counts: uncharged, requeued at once, one more preemption
            assert outcome.effects == (Redeliver(0.0),)
            assert outcome.state.deliveries == before.deliveries - 1
            assert outcome.state.preemptions == before.preemptions + 1
            self.charged -= 1
            self.preempted += 1
        self.apply(outcome, before)

    @rule(alive=st.booleans())
    def lapse(self, alive: bool) -> None:
        before = self.state.copy()
        outcome = machine.lapse(self.state, self.now, RULES, holder_alive=alive)
        if alive and before.status is JobStatus.RUNNING and before.lease_until > self.now:
            assert outcome is Refused.NOT_YET
        self.apply(outcome, before)

    @rule(leaving=st.integers(min_value=0, max_value=2))
    def cancel(self, leaving: int) -> None:
        before = self.state.copy()
        self.apply(machine.cancel(self.state, self.now, leaving), before)

    @rule()
    def join(self) -> None:
        before = self.state.copy()
        self.apply(machine.join(self.state), before)

    @rule(deadline=st.floats(min_value=0.0, max_value=60.0))
    @precondition(lambda self: self.state.deadline is None and self.state.deliveries == 0)
    def set_deadline(self, deadline: float) -> None:
        self.state.deadline = deadline

    @invariant()
    def one_terminal_state(self) -> None:
        assert self.finishes <= 1
        if self.ended_as is not None:
            assert self.state == self.ended_as  # nothing changes a terminal job
        assert self.state.terminal == (self.finishes == 1)

    @invariant()
    def holder_iff_running(self) -> None:
        assert (self.state.holder is not None) == (self.state.status is JobStatus.RUNNING)

    @invariant()
    def deliveries_bounded(self) -> None:
        assert 0 <= self.state.deliveries <= RULES.max_deliveries
        assert self.state.deliveries == self.charged

    @invariant()
    def preemptions_bounded(self) -> None:
        assert self.state.preemptions == self.preempted <= RULES.max_preemptions

    @invariant()
    def cancel_only_while_running(self) -> None:
        if self.state.cancel and not self.state.terminal:
            assert self.state.status is JobStatus.RUNNING


OneJob.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
TestOneJob = OneJob.TestCase


def test_a_job_whose_deliveries_all_lapsed_is_dead_lettered_with_the_one_reason() -> None:
    state = JobState()
    for n in range(RULES.max_deliveries):
        step = machine.take(state, "a", float(n * 20), RULES)
        assert isinstance(step, Step)
        state = step.state
    end = machine.lapse(state, 1000.0, RULES)
    assert isinstance(end, Step) and end.state.status is JobStatus.DEAD
    letter = next(e for e in end.effects if isinstance(e, Bury))
    assert letter.reason == "lease_expired"
    assert letter.error == "lease expired on each of 3 deliveries"
    assert end.state.result is not None and end.state.result.error == letter.error


def test_a_holder_that_died_loses_its_job_before_the_lease_ends() -> None:
    step = machine.take(JobState(), "a", 0.0, RULES)
    assert isinstance(step, Step)
    assert machine.lapse(step.state, 1.0, RULES) is Refused.NOT_YET
    moved = machine.lapse(step.state, 1.0, RULES, holder_alive=False)
    assert isinstance(moved, Step) and moved.effects == (Requeue(),)
    # the dead holder's late completion is fenced
    assert machine.complete(moved.state, "a", ok("x"), 2.0) is Refused.FENCED


def test_a_job_cancelled_while_running_ends_cancelled_when_its_holder_lets_go() -> None:
    held = machine.take(JobState(), "a", 0.0, RULES)
    assert isinstance(held, Step)
    signalled = machine.cancel(held.state, 1.0)
    assert isinstance(signalled, Step) and signalled.effects == (SignalCancel(),)
    for let_go in (
        machine.lapse(signalled.state, 1.0, RULES, holder_alive=False),
        machine.fail(signalled.state, "a", "boom", 1.0, RULES, 0.5),
        machine.release(signalled.state, "a", 1.0),
        machine.preempt(signalled.state, "a", 1.0, RULES),
    ):
        assert isinstance(let_go, Step) and let_go.state.status is JobStatus.CANCELLED


def test_a_job_is_preempted_at_most_max_preemptions_times() -> None:
    state = JobState()
    for n in range(RULES.max_preemptions):
        held = machine.take(state, "a", float(n), RULES)
        assert isinstance(held, Step)
        back = machine.preempt(held.state, "a", float(n), RULES)
        assert isinstance(back, Step) and back.state.status is JobStatus.QUEUED
        state = back.state
    assert state.preemptions == RULES.max_preemptions and state.deliveries == 0
    held = machine.take(state, "b", 10.0, RULES)
    assert isinstance(held, Step)
    assert machine.preempt(held.state, "b", 10.0, RULES) is Refused.SPENT


def test_a_nats_record_carries_every_field_of_the_state_both_ways() -> None:
    # StoredJob copies the fields it shares with JobState by name: each set off its default
    # here, so one the copy left out would come back at its default
    from tokenyard.broker.nats.records import StoredJob
    from tokenyard.messages import JobSpec

    state = JobState(
        status=JobStatus.RUNNING,
        deliveries=2,
        holder="a",
        lease_until=5.0,
        deadline=9.0,
        cancel=True,
        followers=3,
        preemptions=1,
        last_error="lapsed",
        result=ok("x"),
        started_at=1.0,
        finished_at=2.0,
    )
    job = StoredJob(spec=JobSpec(id="j", model="m", deadline=9.0), status=JobStatus.QUEUED)
    job.take_on(state)
    assert job.state() == state
    record = job.record()
    assert (record.status, record.deliveries, record.worker, record.spec.attempt) == (
        JobStatus.RUNNING,
        2,
        "a",
        1,
    )
    assert (record.cancel_requested, record.preemptions, record.last_error) == (True, 1, "lapsed")
    assert (record.result, record.started_at, record.finished_at) == (ok("x"), 1.0, 2.0)
