"""A job's ending stopped between any two of its writes, on every queue core.

Each ending (a worker's completion, its dead letter, a cancel, an expiry found by a claim, a
reap at the delivery limit) runs in a "victim" process side that dies at its k-th write to the
broker: the k-th send, and every one after it, raises instead of leaving (what SIGKILL does to
a process at that point). Every k is tried, from 0 until the ending runs through. A real
worker on another connection then recovers the jobs (redelivery, reap), and readers check each
job's record against its events: a terminal record must never be read without its whole stream
and exactly one Finished, and every job must end that way.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import aiormq.channel
import nats.aio.client
import pytest
import redis.asyncio.connection

from tests.conftest import BackendFactory, kinds
from tokenyard.broker import Backend, new_job_id
from tokenyard.broker.core import Lease
from tokenyard.broker.nats import client as nats_client
from tokenyard.broker.redis import channel
from tokenyard.config import WorkerSettings
from tokenyard.engines.sim import SimEngine, SimTokenizer
from tokenyard.messages import (
    Finished,
    FinishReason,
    JobResult,
    JobSpec,
    JobStatus,
    SamplingParams,
    TokenChunk,
)
from tokenyard.worker.worker import Worker

pytestmark = [
    pytest.mark.fault,
    pytest.mark.parametrize("make_backend", kinds(), indirect=True),
]

MODEL = "torn"
LEASE_S = 4.0  # long enough for every crash point to be tried before the first lease lapses
MOST_WRITES = 80  # an ending with more writes than this is a finding of its own


class Crashed(BaseException):
    """The victim died here: nothing it would send from now on leaves (no `except Exception`
    in the code under test may take it for an error to handle)."""


@dataclass
class Gate:
    """How many sends the victim makes before it dies, and how many it made."""

    allowed: int
    made: int = 0
    crashed: bool = False


_GATE: ContextVar[Gate | None] = ContextVar("torn_gate", default=None)


def _gated(send: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    @functools.wraps(send)
    async def gated(*args: Any, **kwargs: Any) -> Any:
        gate = _GATE.get()
        if gate is not None:
            if gate.crashed or gate.made >= gate.allowed:
                gate.crashed = True
                raise Crashed
            gate.made += 1
        return await send(*args, **kwargs)

    return gated


def _gated_batch(send: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """A write of many messages at once, each counted as a send: a victim allowed fewer dies
    after those it may send went out (a connection cut in the middle of the write)."""

    @functools.wraps(send)
    async def gated(self: Any, messages: Sequence[Any]) -> Any:
        gate = _GATE.get()
        if gate is not None:
            room = 0 if gate.crashed else max(0, gate.allowed - gate.made)
            if room < len(messages):
                if room:
                    await send(self, messages[:room])
                    gate.made += room
                gate.crashed = True
                raise Crashed
            gate.made += len(messages)
        return await send(self, messages)

    return gated


@pytest.fixture(autouse=True)
def gated_sends(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every way a backend writes to its broker, counted and cut inside a gate's context only:
    NATS messages (nats-py's publish and the backend's own), Redis commands (and pipelines,
    through redis-py or the broker's channel), AMQP publishes and acknowledgements."""
    sends: list[tuple[type, str]] = [
        (nats.aio.client.Client, "publish"),
        # the NATS backend's hot path (publish answers, acks) writes past nats-py's publish
        (nats_client.Client, "publish_now"),
        (redis.asyncio.connection.AbstractConnection, "send_packed_command"),
        # the hot path's own channel (broker/redis/channel.py) writes on connections it took
        # over from redis-py, past send_packed_command
        (channel._Wire, "exchange"),
        *((aiormq.channel.Channel, n) for n in ("basic_publish", "basic_ack", "basic_nack")),
        (aiormq.channel.Channel, "basic_reject"),
    ]
    for owner, name in sends:
        monkeypatch.setattr(owner, name, _gated(getattr(owner, name)))
    # the NATS hot path's writes of many messages at once (a claim's records, a completion's
    # Finished events, an enqueue's lane messages): cut anywhere among them
    monkeypatch.setattr(
        nats_client.Client, "publish_all", _gated_batch(nats_client.Client.publish_all)
    )
    yield


async def until_crash(allowed: int, step: Callable[[], Awaitable[object]]) -> Gate:
    """Run `step` as a victim that dies at its `allowed`-th send."""
    gate = Gate(allowed)

    async def victim() -> None:
        _GATE.set(gate)
        await step()

    with contextlib.suppress(Crashed):
        await asyncio.wait_for(asyncio.create_task(victim()), 30)
    return gate


TOKENIZER = SimTokenizer()


def chunk(text: str) -> TokenChunk:
    return TokenChunk(token_ids=TOKENIZER.encode(text), text=text)


def job(deadline: float | None = None) -> JobSpec:
    return JobSpec(
        id=new_job_id(MODEL),
        model=MODEL,
        prompt="tell me",
        stream=True,
        deadline=deadline,
        sampling=SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
    )


async def held(victim: Backend, spec: JobSpec) -> Lease:
    """The victim claims the job and streams its first two tokens. (On RabbitMQ an earlier
    victim's jobs come back as soon as its connection closes: this one may take some too, and
    dies holding them.)"""
    give_up = time.monotonic() + 15
    while True:
        assert time.monotonic() < give_up, "the victim never got its job"
        leases = await victim.queue.claim(MODEL, "victim", 8, block_s=1.0)
        lease = next((lease for lease in leases if lease.spec.id == spec.id), None)
        if lease is not None:
            break
    assert await victim.queue.append_events([(lease, chunk("a")), (lease, chunk("b"))])
    return lease


def succeeded(text: str) -> JobResult:
    ids = TOKENIZER.encode(text)
    return JobResult(
        status=JobStatus.SUCCEEDED,
        finish_reason=FinishReason.LENGTH,
        text=text,
        token_ids=ids,
        completion_tokens=len(ids),
    )


async def complete(victim: Backend, spec: JobSpec) -> Callable[[], Awaitable[object]]:
    lease = await held(victim, spec)
    return lambda: victim.queue.complete_many([(lease, succeeded("abc"))], [chunk("c")])


async def dead_letter(victim: Backend, spec: JobSpec) -> Callable[[], Awaitable[object]]:
    lease = await held(victim, spec)
    return lambda: victim.queue.dead_letter(lease, "bad_request", "no good")


async def cancel(victim: Backend, spec: JobSpec) -> Callable[[], Awaitable[object]]:
    return lambda: victim.queue.cancel(spec.id)


async def expire(victim: Backend, spec: JobSpec) -> Callable[[], Awaitable[object]]:
    assert spec.deadline is not None
    await asyncio.sleep(max(0.0, spec.deadline - time.time()) + 0.05)
    return lambda: victim.queue.claim(MODEL, "victim", 1)


async def reap(victim: Backend, spec: JobSpec) -> Callable[[], Awaitable[object]]:
    """The victim's own lease lapses on the job's last allowed delivery; its reap ends it."""
    await held(victim, spec)
    await asyncio.sleep(victim.settings.lease_s + 0.2)
    return lambda: victim.queue.reap(MODEL)


ENDINGS = {
    "complete": complete,
    "dead_letter": dead_letter,
    "cancel": cancel,
    "expire": expire,
    "reap": reap,
}
# a lease that lapses while the test waits, on the last delivery allowed
SETTINGS: dict[str, dict[str, Any]] = {"reap": dict(lease_s=0.5, max_deliveries=1)}


async def disagreement(reader: Backend, job_id: str) -> tuple[bool, str | None]:
    """(whether the record is terminal, what is wrong with it and its events, None if
    nothing): read record first, events after, as a reader that found the job ended would."""
    record = await reader.queue.record(job_id)
    if record is None:
        return False, "no record"
    if not record.status.terminal:
        return False, None
    events = [e for _, e in await reader.queue.read_events(job_id, count=10_000)]
    finished = [e for e in events if isinstance(e, Finished)]
    text = "".join(e.text for e in events if isinstance(e, TokenChunk))
    result = record.result
    if len(finished) != 1 or events[-1] is not finished[0]:
        return True, f"{record.status}: {len(finished)} Finished, events {events!r}"
    if result is None or finished[0].result != result or result.status is not record.status:
        return True, f"record {record.status} {result!r}, Finished {finished[0].result!r}"
    if record.status is JobStatus.SUCCEEDED and text != result.text:
        return True, f"record succeeded with {result.text!r}, events say {text!r}"
    return True, None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ending", list(ENDINGS))
async def test_an_ending_stopped_between_any_two_writes_leaves_record_and_events_agreeing(
    make_backend: BackendFactory, ending: str
) -> None:
    settings = SETTINGS.get(ending, dict(lease_s=LEASE_S, max_deliveries=20))
    reader = make_backend(**settings)
    jobs: dict[int, str] = {}  # crash point -> its job
    for allowed in range(MOST_WRITES):
        deadline = time.time() + 0.3 if ending == "expire" else None
        spec = job(deadline)
        await reader.queue.enqueue(spec)
        victim = make_backend(**settings)
        step = await ENDINGS[ending](victim, spec)
        gate = await until_crash(allowed, step)
        await victim.close()  # the process is gone: its connections with it
        jobs[allowed] = spec.id
        terminal, wrong = await disagreement(reader, spec.id)
        assert wrong is None, f"stopped after {allowed} writes: {wrong}"
        if not gate.crashed:
            assert terminal, f"the {ending} ran through ({allowed} writes) but left no end"
            break
    else:
        pytest.fail(f"{ending} still writing after {MOST_WRITES} sends")
    assert len(jobs) > 1, f"{ending} made no write at all"
    print(f"{make_backend.kind} {ending}: {len(jobs) - 1} writes, stopped before each")

    # a real worker takes over: what was not ended is redelivered (or reaped) and run again
    survivor = make_backend(**settings)
    options = WorkerSettings(
        model=MODEL, engine="sim", max_seqs=8, heartbeat_s=0.2, claim_block_s=0.1
    )
    worker = Worker(survivor, SimEngine(), options, consumer="survivor")
    running = asyncio.create_task(worker.run())
    try:
        give_up = time.monotonic() + 6 * LEASE_S
        while True:
            verdicts = {k: await disagreement(reader, j) for k, j in jobs.items()}
            torn = {k: w for k, (_, w) in verdicts.items() if w is not None}
            assert not torn, f"record and events disagree (by crash point): {torn}"
            if all(terminal for terminal, _ in verdicts.values()):
                break
            left = [k for k, (terminal, _) in verdicts.items() if not terminal]
            assert time.monotonic() < give_up, f"jobs stopped at writes {left} never ended"
            await asyncio.sleep(0.2)
        records = await reader.queue.records(list(jobs.values()))
        ends = [
            f"{k}:{r.status.value}@{r.deliveries}" for k, r in zip(jobs, records, strict=True) if r
        ]
        print(f"{make_backend.kind} {ending} ended (crash point:status@deliveries): {ends}")
    finally:
        worker.drain()
        await asyncio.wait_for(running, 30)
