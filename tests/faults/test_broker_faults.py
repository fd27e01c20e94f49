"""Fault tests on real processes: consumers and servers are killed, stopped and restarted.

Each test counts lost jobs (no terminal record at the end) and duplicated ones (a completion
the broker accepted more than once, counted by the consumers in a log of their own). The tests
run on every backend kind that has what they need (tests/conftest.py `kinds`): a consumer's
fault on every one, a server's crash wherever the harness can restart the kind's server, a
partition wherever it can cut a client off.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from redis.exceptions import RedisError

from tests.conftest import BackendFactory, kinds, session_urls
from tests.faults.consumer import ACCEPTED_DIR_ENV, read_accepted, result_text
from tests.servers import Can, Restartable, partitioned, restartable
from tokenyard.broker import Backend, connect, new_job_id
from tokenyard.broker.core import Trait
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.config import BrokerSettings, WorkerSettings
from tokenyard.engines.sim import SimEngine
from tokenyard.errors import BrokerUnavailable
from tokenyard.messages import (
    Finished,
    JobEvent,
    JobRecord,
    JobResult,
    JobSpec,
    JobStatus,
    SamplingParams,
    TokenChunk,
)
from tokenyard.worker.worker import Worker

pytestmark = pytest.mark.fault
# a consumer's fault needs nothing of the harness: every kind
KINDS = pytest.mark.parametrize("make_backend", kinds(), indirect=True)

REPO = Path(__file__).resolve().parents[2]
MODEL = "faulty"


# -- helpers -------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def accepted_logs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The consumers' accepted logs go to the test's tmp dir (they inherit the environment)."""
    monkeypatch.setenv(ACCEPTED_DIR_ENV, str(tmp_path))


class ConsumerProcess:
    """`python -m tests.faults.consumer` in a child process; a thread collects its output."""

    def __init__(self, url: str, prefix: str, name: str, **options: object) -> None:
        argv = [sys.executable, "-m", "tests.faults.consumer", "--url", url, "--prefix", prefix]
        argv += ["--model", MODEL, "--name", name]
        for key, value in options.items():
            argv += [f"--{key.replace('_', '-')}", str(value)]
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
        self.name = name
        self.proc = subprocess.Popen(
            argv,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": path},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def _last(self, word: str) -> list[str] | None:
        for line in reversed(self.lines):
            parts = line.split()
            if parts and parts[0] == word:
                return parts
        return None

    @property
    def ready(self) -> bool:
        return self._last("ready") is not None

    @property
    def claimed(self) -> int:
        last = self._last("claimed")
        return int(last[2]) if last else 0

    @property
    def accepted(self) -> int:
        last = self._last("completed")
        return int(last[3]) if last else 0

    @property
    def fenced(self) -> int:
        last = self._last("completed")
        return int(last[4]) if last else 0

    def tail(self, n: int = 15) -> str:
        return f"--- {self.name} (exit {self.proc.poll()}) ---\n" + "\n".join(self.lines[-n:])

    def send(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    def stop(self) -> None:
        """Kill the process for good (SIGCONT first, in case a test left it stopped)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(10)
        self._reader.join(5)


async def eventually(
    check: Callable[[], bool | Awaitable[bool]],
    what: str,
    within_s: float = 15.0,
    procs: Sequence[ConsumerProcess] = (),
) -> None:
    """Poll `check` until true; fail with the consumers' output if it never is."""
    give_up = time.monotonic() + within_s
    while True:
        outcome = check()
        if not isinstance(outcome, bool):
            outcome = await outcome
        if outcome:
            return
        if time.monotonic() > give_up:
            pytest.fail(
                f"timed out after {within_s}s waiting for: {what}\n"
                + "\n".join(p.tail() for p in procs)
            )
        # a consumer that died (not one we stopped on purpose) will never get there
        for p in procs:
            if p.proc.poll() not in (None, -signal.SIGKILL):
                pytest.fail(f"consumer died while waiting for: {what}\n{p.tail()}")
        await asyncio.sleep(0.05)


@dataclass
class Audit:
    """Every job's fate: lost (no terminal record) or duplicated (accepted more than once)."""

    records: dict[str, JobRecord] = field(default_factory=dict)
    lost: list[str] = field(default_factory=list)
    duplicated: dict[str, int] = field(default_factory=dict)
    accepted: Counter[str] = field(default_factory=Counter)
    finished_events: Counter[str] = field(default_factory=Counter)

    @property
    def statuses(self) -> Counter[JobStatus]:
        return Counter(r.status for r in self.records.values())


async def audit(broker: Backend, ids: Sequence[str]) -> Audit:
    result = Audit()
    # the consumers log accepted completions in a file of their own (consumer.py)
    result.accepted = read_accepted(broker.settings.prefix)
    result.duplicated = {j: n for j, n in result.accepted.items() if n > 1}
    for job_id in ids:
        record = await broker.queue.record(job_id)
        if record is None or not record.status.terminal:
            result.lost.append(job_id)
            continue
        result.records[job_id] = record
        events = await broker.queue.read_events(job_id)
        result.finished_events[job_id] = sum(isinstance(e, Finished) for _, e in events)
    return result


def spec(i: int, prompt: str | None = None, key: str | None = None) -> JobSpec:
    return JobSpec(
        id=new_job_id(MODEL),
        model=MODEL,
        prompt=prompt or f"prompt {i}",
        idempotency_key=key,
        sampling=SamplingParams(max_tokens=4, temperature=0.0),
    )


def batched(items: Sequence[JobSpec], n: int) -> Iterator[Sequence[JobSpec]]:
    for i in range(0, len(items), n):
        yield items[i : i + n]


def new_prefix() -> str:
    return f"f{uuid.uuid4().hex[:10]}"


# -- tests ---------------------------------------------------------------------------------


@KINDS
@pytest.mark.timeout(120)
async def test_sigkill_consumer_holding_2000_jobs_loses_and_duplicates_nothing(
    make_backend: BackendFactory,
) -> None:
    n = 2000
    broker = make_backend()
    url, prefix = make_backend.url, make_backend.prefix
    specs = [spec(i) for i in range(n)]
    for chunk in batched(specs, 500):
        await broker.queue.enqueue_many(chunk)
    procs: list[ConsumerProcess] = []
    try:
        # holds everything it claims for far longer than the test runs, never renewing. The
        # lease a rescuer waits out is the holder's own on NATS (AckWait and the record's
        # deadline are set at claim) but the reaper's idle threshold on Redis: long enough
        # that the holder claims all before any lapses, short enough for the rescue below
        holder = ConsumerProcess(
            url, prefix, "holder", slots=n, hold_s=300, lease_s=5, reap_every_s=300
        )
        procs.append(holder)
        await eventually(lambda: holder.claimed >= n, f"holder claims {n}", procs=procs)
        [normal] = [lane for lane in (await broker.queue.stats(MODEL)).lanes if lane.in_flight]
        assert normal.in_flight == n and normal.waiting == 0

        holder.send(signal.SIGKILL)
        holder.proc.wait(5)
        rescuer = ConsumerProcess(url, prefix, "rescuer", slots=256, lease_s=1.0, reap_every_s=0.25)
        procs.append(rescuer)
        # NATS rescues a dead holder's jobs at ~40-100/s here (redeliveries after AckWait, a
        # record CAS each): 60 s keeps a slow CI box from failing what is only slow
        await eventually(lambda: rescuer.accepted >= n, f"rescuer completes {n}", 60, procs)

        found = await audit(broker, [s.id for s in specs])
        assert found.lost == [] and found.duplicated == {}
        assert found.statuses == {JobStatus.SUCCEEDED: n}
        assert sum(found.accepted.values()) == n
        assert set(found.finished_events.values()) == {1}
        for s in specs:
            record = found.records[s.id]
            assert record.result is not None
            assert record.result.text == result_text("rescuer", s.prompt)
            assert record.deliveries == 2  # the holder's, then the rescuer's
        stats = await broker.queue.stats(MODEL)
        assert all(lane.in_flight == lane.waiting == 0 for lane in stats.lanes)
        assert stats.fenced_completions == 0 and stats.dead_letters == 0
    finally:
        for p in procs:
            p.stop()


@KINDS
@pytest.mark.timeout(60)
async def test_sigstopped_consumer_is_fenced_after_another_finishes_its_job(
    make_backend: BackendFactory,
) -> None:
    lease_s, hold_s = 1.0, 1.5
    broker = make_backend()
    url, prefix = make_backend.url, make_backend.prefix
    job = spec(0, "the one job")
    await broker.queue.enqueue(job)
    procs: list[ConsumerProcess] = []
    try:
        # renews while it works; once stopped, its lease runs out
        zombie = ConsumerProcess(
            url,
            prefix,
            "zombie",
            slots=4,
            lease_s=lease_s,
            hold_s=hold_s,
            renew_every_s=0.2,
            reap_every_s=0.25,
        )
        procs.append(zombie)
        await eventually(lambda: zombie.claimed >= 1, "zombie claims the job", procs=procs)
        claimed_at = time.monotonic()
        zombie.send(signal.SIGSTOP)

        survivor = ConsumerProcess(
            url, prefix, "survivor", slots=4, lease_s=lease_s, reap_every_s=0.1
        )
        procs.append(survivor)
        await eventually(lambda: survivor.accepted >= 1, "survivor completes", procs=procs)
        record = await broker.queue.record(job.id)
        assert record is not None and record.status is JobStatus.SUCCEEDED

        # resume only once the zombie's hold is over, so it completes without renewing first
        await asyncio.sleep(max(0.0, claimed_at + hold_s + 0.2 - time.monotonic()))
        zombie.send(signal.SIGCONT)
        await eventually(lambda: zombie.fenced >= 1, "zombie's completion is fenced", procs=procs)

        assert zombie.accepted == 0
        assert (await broker.queue.stats(MODEL)).fenced_completions >= 1
        found = await audit(broker, [job.id])
        assert found.lost == [] and found.duplicated == {}
        assert found.accepted == {job.id: 1}
        assert found.finished_events[job.id] == 1
        result = found.records[job.id].result
        assert result is not None and result.text == result_text("survivor", job.prompt)
        assert result.worker == "survivor" and found.records[job.id].deliveries == 2
    finally:
        for p in procs:
            p.stop()


async def crash_and_restart_under_enqueues(server: Restartable) -> None:
    """Producers enqueue while `server` is SIGKILLed and brought back on its store; then every
    acknowledged job must run, once. Where the server must settle before a kill (its `settle`,
    called once the lanes exist) a consumer runs throughout, crash included."""
    url, tables_url, mid_run = server.url, server.tables_url, server.settle
    prefix = new_prefix()
    broker = connect(BrokerSettings(url=url, tables_url=tables_url, prefix=prefix))
    acknowledged: list[str] = []
    before_crash: list[str] = []
    errors: Counter[str] = Counter()
    already_there = 0  # a resubmitted batch whose first try had landed before the crash
    stop = asyncio.Event()

    async def produce() -> None:
        nonlocal already_there
        i = 0
        unanswered: list[list[JobSpec]] = []
        while unanswered or not stop.is_set():
            if unanswered:
                batch = unanswered[0]
            else:
                # idempotency keys make resubmitting a batch whose fate is unknown safe
                batch = [spec(i + k, key=f"k{i + k}") for k in range(10)]
                i += len(batch)
            try:
                results = await broker.queue.enqueue_many(batch)
            except (BrokerUnavailable, RedisError, OSError) as exc:
                if not unanswered:
                    unanswered.append(batch)
                errors[type(exc).__name__] += 1
                await asyncio.sleep(0.02)
                continue
            if unanswered:
                unanswered.pop(0)
            assert [r.job_id for r in results] == [s.id for s in batch]
            already_there += sum(not r.created for r in results)
            acknowledged.extend(r.job_id for r in results)

    procs: list[ConsumerProcess] = []
    if mid_run is not None:
        # the lanes exist before the crash
        acknowledged.append((await broker.queue.enqueue(spec(-1, key="first"))).job_id)
        await asyncio.to_thread(mid_run)
        during = ConsumerProcess(url, prefix, "during", slots=64, lease_s=5, tables=tables_url)
        procs.append(during)
        await eventually(lambda: during.ready, "the consumer is ready", 30, procs)
    producer = asyncio.create_task(produce())
    try:
        await eventually(lambda: len(acknowledged) >= 500, "500 enqueues before the crash")
        # off the event loop, so the producer keeps going while the server dies and comes back
        await asyncio.to_thread(server.kill)
        before_crash = list(acknowledged)
        await asyncio.sleep(server.down_s)
        await asyncio.to_thread(server.start)
        await eventually(
            lambda: len(acknowledged) >= len(before_crash) + 300, "enqueues after the restart"
        )
        stop.set()
        await producer
        assert errors, "the crash never reached the producer"
        assert len(set(acknowledged)) == len(acknowledged)

        if mid_run is None:
            procs.append(
                ConsumerProcess(url, prefix, "after", slots=256, lease_s=5, tables=tables_url)
            )
        await eventually(
            lambda: sum(p.accepted for p in procs) >= len(acknowledged),
            "every acknowledged job",
            60,
            procs,
        )
        found = await audit(broker, acknowledged)
        assert found.lost == [], (
            f"{len(found.lost)} acknowledged jobs lost "
            f"({len(set(found.lost) & set(before_crash))} acknowledged before the crash)"
        )
        assert found.duplicated == {}
        assert found.statuses == {JobStatus.SUCCEEDED: len(acknowledged)}
        assert sum(found.accepted.values()) == len(acknowledged)
        assert set(found.finished_events.values()) == {1}
    finally:
        stop.set()
        producer.cancel()
        await asyncio.gather(producer, return_exceptions=True)
        for p in procs:
            p.stop()
        await broker.close()


@pytest.fixture
def server(
    request: pytest.FixtureRequest, tmp_path: Path, valkey: EmbeddedServer
) -> Iterator[Restartable]:
    """A server of the param's kind for this test alone, to kill and start again (one node of
    a cluster: the one holding MODEL's keys); RabbitMQ lanes keep their tables on the
    session's Valkey, which stays up."""
    with restartable(request.param, tmp_path, tables_url=valkey.url, model=MODEL) as made:
        yield made


RESTARTABLE = pytest.mark.parametrize("server", kinds(Can.RESTART), indirect=True)


@RESTARTABLE
@pytest.mark.timeout(240)
async def test_server_sigkill_keeps_every_acknowledged_enqueue(server: Restartable) -> None:
    await crash_and_restart_under_enqueues(server)


# A lease long enough that a job coming back by lease expiry could not pass for one resumed.
RESTART_LEASE_S = 20.0
TOKENS = 40  # each job's length in the restart tests


def _stepping_engine() -> SimEngine:
    """20 ms a decode step whatever the batch: a job of TOKENS tokens runs 0.8 s."""
    return SimEngine(
        prefill_base=0.001, prefill_per_token=0.0, decode_base=0.02, decode_per_seq=0.0
    )


def _streamed_jobs(n: int) -> list[JobSpec]:
    """`n` streamed jobs that each run their whole TOKENS tokens (ignore_eos)."""
    return [
        JobSpec(
            id=new_job_id(MODEL),
            model=MODEL,
            prompt=f"prompt {i}",
            stream=True,
            sampling=SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True),
        )
        for i in range(n)
    ]


async def _ran_once(broker: Backend, job_id: str, deliveries: int) -> list[JobEvent]:
    """Assert the job succeeded on its `deliveries`-th delivery and its event stream carries
    each of its tokens once (none lost, none twice); its events."""
    record = await broker.queue.record(job_id)
    assert record is not None and record.result is not None
    assert record.status is JobStatus.SUCCEEDED, record.result.error
    assert record.deliveries == deliveries
    assert record.result.completion_tokens == TOKENS
    events = [e for _, e in await broker.queue.read_events(job_id, count=10_000)]
    chunks = [e for e in events if isinstance(e, TokenChunk)]
    assert sum(len(c.token_ids) for c in chunks) == TOKENS, job_id
    assert "".join(c.text for c in chunks) == record.result.text
    return events


async def jobs_in_flight_across_a_restart(server: Restartable) -> float:
    """A real worker streams jobs while `server` is SIGKILLed and brought back on its store
    (down at least a second); every job must finish once, on its first delivery, with every
    token in its event stream once. Returns seconds from the restart to the last job's end."""
    url, prefix = server.url, new_prefix()
    settings = BrokerSettings(
        url=url, tables_url=server.tables_url, prefix=prefix, lease_s=RESTART_LEASE_S
    )
    broker, worker_broker = connect(settings), connect(settings)
    # 64 jobs at once, 96 in all
    options = WorkerSettings(
        model=MODEL, engine="sim", max_seqs=64, heartbeat_s=0.5, claim_block_s=0.2
    )
    worker = Worker(worker_broker, _stepping_engine(), options, consumer="steady")
    running = asyncio.create_task(worker.run())
    try:
        specs = _streamed_jobs(96)
        await broker.queue.enqueue_many(specs)
        ids = [s.id for s in specs]

        async def streaming() -> bool:
            return sum([bool(await broker.queue.read_events(j, count=1)) for j in ids]) >= 32

        await eventually(streaming, "jobs streaming before the crash")
        if server.settle is not None:
            await asyncio.to_thread(server.settle)
        await asyncio.to_thread(server.kill)
        await asyncio.sleep(max(1.0, server.down_s))
        await asyncio.to_thread(server.start)
        restarted = time.monotonic()

        async def all_ended() -> bool:
            try:
                records = await broker.queue.records(ids)
            except BrokerUnavailable:
                return False
            return all(r is not None and r.status.terminal for r in records)

        await eventually(all_ended, "every job ends", within_s=2 * RESTART_LEASE_S)
        took = time.monotonic() - restarted
        print(f"{url.split(':')[0]}: in-flight jobs ended {took:.2f} s after the restart")
        for job_id in ids:
            # resumed by the same worker, not redelivered
            events = await _ran_once(broker, job_id, deliveries=1)
            assert sum(isinstance(e, Finished) for e in events) == 1
        return took
    finally:
        worker.drain()
        await asyncio.wait_for(running, 30)
        await worker_broker.close()
        await broker.close()


@RESTARTABLE
@pytest.mark.timeout(180)
async def test_jobs_in_flight_finish_seconds_after_a_server_restart(server: Restartable) -> None:
    took = await jobs_in_flight_across_a_restart(server)
    # the worker kept what it could not publish and sent it once the server answered: no job
    # waited out its lease
    assert took < RESTART_LEASE_S / 4


# the cut-off worker's liveness: it lapses well within the cut, and not before it
CUT_LIVENESS_S, CUT_S = 0.5, 2.0


@pytest.fixture
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.mark.parametrize("kind", kinds(Can.PARTITION), indirect=True)
@pytest.mark.timeout(90)
async def test_kept_writes_of_a_lease_lost_meanwhile_are_fenced_off(
    kind: str, request: pytest.FixtureRequest
) -> None:
    # the worker reaches its servers (lanes and tables alike) through relays; while they are
    # cut its liveness lapses and another client's reap takes its jobs back (requeued), so
    # what it kept must be refused, and the jobs run again
    url, tables = session_urls(request, kind)
    prefix = new_prefix()
    with partitioned(url, tables) as cut:
        direct = connect(BrokerSettings(url=url, tables_url=tables, prefix=prefix))
        through = connect(
            BrokerSettings(
                url=cut.url,
                tables_url=cut.tables_url,
                prefix=prefix,
                lease_s=RESTART_LEASE_S,
                liveness_s=CUT_LIVENESS_S,
            )
        )
        options = WorkerSettings(
            model=MODEL, engine="sim", max_seqs=16, heartbeat_s=0.5, claim_block_s=0.2
        )
        worker = Worker(through, _stepping_engine(), options, consumer="cut-off")
        running = asyncio.create_task(worker.run())
        try:
            specs = _streamed_jobs(8)
            await direct.queue.enqueue_many(specs)
            ids = [s.id for s in specs]

            async def all_streaming() -> bool:
                return all([bool(await direct.queue.read_events(j, count=1)) for j in ids])

            await eventually(all_streaming, "every job streaming")
            cut.sever(down_s=CUT_S)
            await asyncio.sleep(2 * CUT_LIVENESS_S)  # past the worker's liveness, not its lease
            report = await direct.queue.reap(MODEL)
            assert sorted(report.requeued) == sorted(ids)

            async def all_ended() -> bool:
                records = await direct.queue.records(ids)
                return all(r is not None and r.status.terminal for r in records)

            await eventually(all_ended, "every job ends", within_s=RESTART_LEASE_S / 2)
            if Trait.REAP_FENCES in direct.traits:
                # each job's kept writes were refused: dropped when its renewal was refused
                # (still running), or its completion fenced off (it had ended while cut off)
                sample = worker.metrics.registry.get_sample_value
                lost = sample("tokenyard_worker_leases_lost_total", {"model": MODEL})
                fenced = sample("tokenyard_worker_fenced_completions_total", {"model": MODEL})
                assert (lost or 0) + (fenced or 0) == len(ids), (lost, fenced)
            for job_id in ids:
                # run again, or (without the trait) ended by the cut-off run's kept Finished
                # where it landed before any new claim: either way once, and no token twice
                await _ran_once(direct, job_id, deliveries=2)
        finally:
            worker.drain()
            await asyncio.wait_for(running, 30)
            await through.close()
            await direct.close()


@KINDS
@pytest.mark.timeout(60)
async def test_always_failing_job_is_dead_lettered_and_the_others_succeed(
    make_backend: BackendFactory,
) -> None:
    n, max_deliveries = 200, 3
    broker = make_backend()
    url, prefix = make_backend.url, make_backend.prefix
    bad = spec(-1, "this one will FAIL every time")
    good = [spec(i) for i in range(n)]
    await broker.queue.enqueue_many([bad, *good[:100]])
    await broker.queue.enqueue_many(good[100:])
    options: dict[str, object] = dict(
        slots=32,
        lease_s=5,
        fail_marker="FAIL",
        max_deliveries=max_deliveries,
        backoff_base_s=0.05,
        backoff_max_s=0.2,
    )
    procs = [ConsumerProcess(url, prefix, f"c{i}", **options) for i in range(2)]
    try:

        async def settled() -> bool:
            stats = await broker.queue.stats(MODEL)
            return stats.dead_letters >= 1 and sum(p.accepted for p in procs) >= n

        await eventually(settled, "the bad job dead, the good ones done", 20, procs)

        [letter] = await broker.queue.dead_letters(MODEL)
        assert letter.job_id == bad.id and letter.reason == "failed"
        assert letter.error == f"boom attempt {max_deliveries - 1}"
        assert letter.deliveries == max_deliveries

        found = await audit(broker, [bad.id, *(s.id for s in good)])
        assert found.lost == [] and found.duplicated == {}
        assert found.statuses == {JobStatus.SUCCEEDED: n, JobStatus.DEAD: 1}
        assert bad.id not in found.accepted and sum(found.accepted.values()) == n
        assert set(found.finished_events.values()) == {1}
        dead = found.records[bad.id]
        assert dead.last_error == letter.error and dead.deliveries == max_deliveries
        assert dead.result is not None and letter.error in (dead.result.error or "")
        stats = await broker.queue.stats(MODEL)
        assert stats.delayed == 0 and stats.fenced_completions == 0
    finally:
        for p in procs:
            p.stop()


@KINDS
@pytest.mark.timeout(30)
async def test_resubmitting_an_unanswered_enqueue_without_a_key_runs_the_job_once(
    make_backend: BackendFactory,
) -> None:
    # What a producer does after BrokerUnavailable when its first try had in fact landed.
    broker = make_backend()
    job = spec(0)
    await broker.queue.enqueue(job)
    await broker.queue.enqueue(job)
    leases = await broker.queue.claim(MODEL, "w", slots=10)
    accepted = [
        await broker.queue.complete(x, JobResult(status=JobStatus.SUCCEEDED, text=f"run {i}"))
        for i, x in enumerate(leases)
    ]
    assert accepted.count(True) == 1, f"{len(leases)} leases, accepted {accepted}"
