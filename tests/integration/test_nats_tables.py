"""The NATS backend's tables beyond the conformance suite (which runs every table's behaviour on
NATS too): many clients racing for one quota, batches in chunks, the quota sweep before any job
record exists, tables made by another client, audit paging. Job records are written here as the
queue writes them."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import nats.js.errors
import pytest

from tokenyard.broker import new_job_id
from tokenyard.broker.audit import AuditEntry, received, terminal
from tokenyard.broker.core import Clock
from tokenyard.broker.nats.audit import NatsAudit
from tokenyard.broker.nats.batches import NatsBatches
from tokenyard.broker.nats.connection import NatsConnection
from tokenyard.broker.nats.embedded import EmbeddedNats
from tokenyard.broker.nats.names import Names
from tokenyard.broker.nats.records import StoredJob, encode_job
from tokenyard.broker.nats.responses import NatsResponses
from tokenyard.broker.nats.tables import NatsDirectory, NatsQuotas, NatsRegistry
from tokenyard.config import BrokerSettings
from tokenyard.messages import (
    JobResult,
    JobSpec,
    JobStatus,
    Priority,
    SamplingParams,
    encode,
)
from tokenyard.tenancy.limiter import Quota
from tokenyard.tenancy.records import TenantConfig

MODEL = "tiny"


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
        settings = BrokerSettings(url=self.url, prefix=self.prefix)
        conn = NatsConnection(settings)
        self.made.append(conn)
        names = Names(self.prefix)
        return Tables(
            conn,
            names,
            NatsDirectory(conn, names, clock),
            NatsQuotas(conn, names, clock, settings.pool_count),
            NatsAudit(conn, names, audit_max_len),
            NatsResponses(conn, names, clock),
            NatsRegistry(conn, names, clock),
            NatsBatches(conn, names, clock),
        )


@pytest.fixture
async def make_tables(nats_server: EmbeddedNats) -> AsyncIterator[TablesFactory]:
    factory = TablesFactory(nats_server.url)
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


async def test_concurrent_reservations_from_many_clients_admit_exactly_the_quota(
    make_tables: TablesFactory,
) -> None:
    clients = [make_tables() for _ in range(4)]
    quota = Quota(rpm=10)
    decisions = await asyncio.gather(
        *(clients[i % 4].quotas.reserve("acme", quota, [(f"j{i}", 1)]) for i in range(30))
    )
    assert sum(d.admitted for [d] in decisions) == 10


async def put_job(
    broker: Tables, spec: JobSpec, status: JobStatus, result: JobResult | None = None
) -> None:
    """Write a job's record as the queue does."""
    jobs = await broker.conn.kv(broker.names.jobs_bucket)
    stored = StoredJob(spec=spec, status=status, enqueued_at=time.time(), result=result)
    await jobs.put(Names.job(spec.id), encode_job(stored))


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
