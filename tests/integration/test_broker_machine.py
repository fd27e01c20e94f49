"""Every backend held to the one job state machine (tokenyard/broker/machine.py): random
operation sequences (claims, completions, retries, dead letters, releases, preemptions,
renewals, cancels,
followers leaving; stale leases included) applied to a real backend and to the pure machine
end each step in the same states and answers."""

from __future__ import annotations

import random

import pytest

from tests.conftest import BACKENDS, BackendFactory
from tests.integration.test_broker_conformance import MODEL, job, ok
from tokenyard.broker import machine
from tokenyard.broker.core import CancelOutcome, Lease, QueueCore
from tokenyard.broker.machine import Finish, JobState, Redeliver, Refused, Rules, Step
from tokenyard.messages import JobRecord, JobStatus

pytestmark = pytest.mark.parametrize("make_backend", list(BACKENDS), indirect=True)

RULES = Rules(lease_s=30.0, max_deliveries=3, max_preemptions=2)
CONSUMERS = ("w1", "w2")
OPS = (
    "claim",
    "claim",
    "complete",
    "retry",
    "dead",
    "release",
    "preempt",
    "renew",
    "cancel",
    "leave",
)


class Model:
    """The machine's view of the jobs a sequence works on, and the leases ever handed out."""

    def __init__(self) -> None:
        self.states: dict[str, JobState] = {}
        self.leases: list[Lease] = []

    def apply(self, job_id: str, outcome: machine.Outcome) -> machine.Outcome:
        if isinstance(outcome, Step):
            self.states[job_id] = outcome.state
        return outcome


def same(record: JobRecord | None, state: JobState, why: str) -> None:
    assert record is not None, why
    cancel = record.cancel_requested and not record.status.terminal
    got = (record.status, record.deliveries, cancel, record.preemptions)
    want = (state.status, state.deliveries, state.cancel and not state.terminal, state.preemptions)
    assert got == want, why
    if state.status is JobStatus.RUNNING:
        assert record.worker == state.holder, why
    if state.terminal:
        assert record.result is not None and state.result is not None, why
        assert (record.result.status, record.result.text) == (
            state.result.status,
            state.result.text,
        ), why


async def step(queue: QueueCore, model: Model, rng: random.Random, log: list[str]) -> None:
    op = rng.choice(OPS)
    now = queue.clock()
    if op == "claim":
        consumer = rng.choice(CONSUMERS)
        for lease in await queue.claim(MODEL, consumer, slots=1):
            taken = machine.take(model.states[lease.spec.id], consumer, now, RULES)
            log.append(f"claim {consumer} -> {lease.spec.id[-4:]} ({taken})")
            assert isinstance(taken, Step) and taken.state.status is JobStatus.RUNNING, log
            model.apply(lease.spec.id, taken)
            model.leases.append(lease)
        return
    if op in ("cancel", "leave"):
        job_id = rng.choice(list(model.states))
        leaving = 1 if op == "leave" else 0
        outcome = model.apply(job_id, machine.cancel(model.states[job_id], now, leaving))
        got = await (queue.leave(job_id) if leaving else queue.cancel(job_id))
        log.append(f"{op} {job_id[-4:]} -> {got}")
        if outcome is Refused.FINISHED:
            want = CancelOutcome.ALREADY_FINISHED
        else:
            assert isinstance(outcome, Step)
            if outcome.ended:
                want = CancelOutcome.CANCELLED
            elif outcome.effects:
                want = CancelOutcome.SIGNALLED
            else:
                want = CancelOutcome.FOLLOWED
        assert got is want, log
        return
    if not model.leases:
        return
    lease = rng.choice(model.leases)
    job_id, consumer = lease.spec.id, lease.consumer
    state = model.states[job_id]
    # a lease of an earlier delivery is stale even when the same consumer holds the job again
    current = state.holder == consumer and _latest(model, lease)
    held = state if current else _unheld(state)
    if op == "complete":
        outcome = machine.complete(held, consumer, ok(lease, "done"), now)
        answer = await queue.complete(lease, ok(lease, "done"))
        want = isinstance(outcome, Step)
    elif op in ("retry", "dead"):
        reason = "bad_input" if op == "dead" else None
        outcome = machine.fail(held, consumer, "boom", now, RULES, 0.0, reason)
        if op == "retry":
            answer = await queue.retry(lease, "boom")
            want = isinstance(outcome, Step) and any(
                isinstance(e, Redeliver) for e in outcome.effects
            )
        else:
            answer = await queue.dead_letter(lease, "bad_input", "boom")
            want = isinstance(outcome, Step) and any(isinstance(e, Finish) for e in outcome.effects)
    elif op == "preempt":
        outcome = machine.preempt(held, consumer, now, RULES)
        [how] = await queue.preempt([lease])
        answer = bool(how)  # the holder lets the job go (preempted, or ended cancelled)
        want = isinstance(outcome, Step)
    elif op == "release":
        outcome = machine.release(held, consumer, now)
        answer = await queue.release([lease]) == 1
        want = isinstance(outcome, Step)
    else:
        outcome = machine.renew(held, consumer, now, RULES)
        answer = (await queue.renew([lease]))[0]
        want = isinstance(outcome, Step)
    log.append(f"{op} {consumer}@{job_id[-4:]} current={current} -> {answer} ({outcome})")
    if isinstance(outcome, Step) and current:
        model.apply(job_id, outcome)
    assert answer == want, "\n".join(log[-6:])


def _latest(model: Model, lease: Lease) -> bool:
    mine = [x for x in model.leases if x.spec.id == lease.spec.id]
    return mine[-1] is lease


def _unheld(state: JobState) -> JobState:
    """The state as a stale lease's holder sees it: not theirs."""
    stale = state.copy()
    if stale.status is JobStatus.RUNNING:
        stale.holder = "\0stale"  # held, by no consumer a lease names
    return stale


@pytest.mark.parametrize("seed", range(6))
async def test_random_operations_end_where_the_machine_says(
    make_backend: BackendFactory, seed: int
) -> None:
    broker = make_backend(
        max_deliveries=RULES.max_deliveries,
        max_preemptions=RULES.max_preemptions,
        backoff_base_s=0.0,
    )
    queue = broker.queue
    rng = random.Random(seed)
    model = Model()
    for _ in range(3):
        spec = job()
        assert (await queue.enqueue(spec)).created
        model.states[spec.id] = JobState()
    log: list[str] = []
    for _ in range(40):
        await step(queue, model, rng, log)
        for job_id, record in zip(
            model.states, await queue.records(list(model.states)), strict=True
        ):
            same(record, model.states[job_id], "\n".join(log[-8:]))
