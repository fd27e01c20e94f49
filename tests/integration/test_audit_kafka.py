"""The Kafka audit log against a real Kafka-protocol broker (Tansu): entries from the real
enqueue and terminal paths arrive keyed by tenant, `tokenyard audit --from kafka://` replays
them with the export's filters, an outage is bridged by the buffer, what never reaches Kafka
is counted, and with the defaults the producer gives up idempotence Tansu refuses, saying so."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from prometheus_client import CollectorRegistry

from tests.conftest import BackendFactory
from tests.integration.test_broker_conformance import MODEL, job, ok
from tests.servers import Tansu
from tokenyard.broker import Backend, new_job_id
from tokenyard.broker.audit import AuditEntry
from tokenyard.broker.kafka import KafkaAuditLog, KafkaTarget
from tokenyard.children import free_port
from tokenyard.errors import FatalError
from tokenyard.fleet.launch import Processes, tokenyard_command, wait_ready
from tokenyard.metrics import AuditLogMetrics

pytestmark = pytest.mark.kafka  # a Tansu server: `make test-brokers`

# the defaults but a shorter linger: idempotence "auto", which Tansu 0.6's memory engine
# refuses (InitProducerId v0 answered UNKNOWN), so every sink here falls back to acks=all
KAFKA = {"audit_kafka_linger_ms": 5}
REFUSED = "refuses the idempotent producer"


def topic() -> str:
    return f"audit-{uuid.uuid4().hex[:10]}"


async def fetch(servers: str, name: str, expect: int, timeout_s: float = 20.0) -> list[Any]:
    """Records of topic `name`, read from the start until `expect` came (counted by fetching:
    Tansu's end offsets count batches, not records) or the time is up."""
    # `partitions_for_topic` reads the metadata the consumer cached, which `topics()` leaves
    # as it is: refreshed every 5 min by default, it would not learn of a topic the producer
    # creates just after the consumer started (the test failed so ~1 run in 2)
    consumer = AIOKafkaConsumer(
        bootstrap_servers=servers, enable_auto_commit=False, metadata_max_age_ms=100
    )
    await consumer.start()
    records: list[Any] = []
    try:
        give_up = time.monotonic() + timeout_s
        parts: set[int] | None = None
        while not parts and time.monotonic() < give_up:
            # a topic being created may be listed before its partitions are
            if name in await consumer.topics():
                parts = consumer.partitions_for_topic(name)
            if not parts:
                await asyncio.sleep(0.1)
        if not parts:
            return records
        tps = [TopicPartition(name, p) for p in parts]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        while len(records) < expect and time.monotonic() < give_up:
            got = await consumer.getmany(timeout_ms=200)
            for batch in got.values():
                records += batch
        # a moment more: anything past `expect` would be a duplicate or a stray entry
        for batch in (await consumer.getmany(timeout_ms=300)).values():
            records += batch
    finally:
        await consumer.stop()
    return records


def entries_of(records: list[Any]) -> list[tuple[bytes, AuditEntry]]:
    return [(r.key, msgspec.json.decode(r.value, type=AuditEntry)) for r in records]


async def trail(broker: Backend, since: float) -> list[AuditEntry]:
    cursor, out = None, []
    while True:
        cursor, entries = await broker.audit.audit_entries(since, cursor=cursor)
        out += entries
        if cursor is None:
            return out


async def run_jobs(broker: Backend) -> None:
    """Receipts and ends from the real paths: completed, dead letter, cancelled; plus an
    idempotent replay and a fenced completion, which the trail takes back."""
    done, dead, gone = job(tenant="acme"), job(tenant="acme"), job(tenant="bob")
    for spec in (done, dead, gone):
        assert (await broker.queue.enqueue(spec)).created
    await broker.queue.enqueue(job(tenant="acme", key="k1"))
    assert not (await broker.queue.enqueue(job(tenant="acme", key="k1"))).created
    await broker.queue.cancel(gone.id)
    leases = {lease.spec.id: lease for lease in await broker.queue.claim(MODEL, "w1", slots=2)}
    assert await broker.queue.complete(leases[done.id], ok(leases[done.id]))
    assert not await broker.queue.complete(leases[done.id], ok(leases[done.id]))
    assert await broker.queue.dead_letter(leases[dead.id], "bad_input", "no")


@pytest.mark.parametrize("make_backend", ["valkey", "nats", "rabbitmq"], indirect=True)
async def test_entries_of_real_jobs_arrive_keyed_by_tenant(
    make_backend: BackendFactory, tansu: Tansu
) -> None:
    name = topic()
    broker = make_backend(audit_kafka=tansu.url(name), **KAFKA)
    assert broker.audit_log is not None
    start = time.time() - 1
    await run_jobs(broker)
    written = await trail(broker, start)
    assert len(written) == 7  # 4 receipts, 3 ends: the replay and the fenced end taken back
    records = await fetch(tansu.servers, name, len(written))
    got = entries_of(records)
    assert sorted((e.job_id, e.event, e.status) for _, e in got) == sorted(
        (e.job_id, e.event, e.status) for e in written
    )
    assert all(key == entry.tenant.encode() for key, entry in got)
    for tenant in (b"acme", b"bob"):  # a tenant's entries share one partition: one order
        assert len({r.partition for r in records if r.key == tenant}) == 1
    assert broker.audit_log.sent == 7 and broker.audit_log.dropped == 0
    assert broker.audit_log.idempotence is False  # Tansu refused it; "auto" went on without


async def test_auto_idempotence_falls_back_on_a_broker_refusing_it_and_says_so_once(
    make_backend: BackendFactory, tansu: Tansu, caplog: pytest.LogCaptureFixture
) -> None:
    name = topic()
    broker = make_backend(audit_kafka=tansu.url(name))  # every Kafka setting its default
    log = broker.audit_log
    assert log is not None and log.idempotent == "auto" and log.idempotence is None
    with caplog.at_level(logging.WARNING, logger="tokenyard.broker.kafka"):
        ids = []
        for _ in range(100):
            spec = job(tenant=f"t{len(ids) % 7}")
            assert (await broker.queue.enqueue(spec)).created
            ids.append(spec.id)
        deadline = time.monotonic() + 20
        while log.sent < 100 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    assert (log.sent, log.buffered, log.dropped, log.idempotence) == (100, 0, 0, False)
    got = entries_of(await fetch(tansu.servers, name, 100))
    assert sorted(e.job_id for _, e in got) == sorted(ids)
    said = [r for r in caplog.records if REFUSED in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    assert "acks=all" in said[0].getMessage() and tansu.servers in said[0].getMessage()


async def test_required_idempotence_refused_sends_nothing_says_so_and_counts_the_loss(
    make_backend: BackendFactory, tansu: Tansu, caplog: pytest.LogCaptureFixture
) -> None:
    broker = make_backend(audit_kafka=tansu.url(topic()), audit_kafka_idempotent=True, **KAFKA)
    log = broker.audit_log
    assert log is not None
    registry = CollectorRegistry()
    log.observe(AuditLogMetrics("tokenyard", registry))
    with caplog.at_level(logging.WARNING, logger="tokenyard.broker.kafka"):
        for _ in range(10):
            assert (await broker.queue.enqueue(job(tenant="t"))).created
        await asyncio.sleep(3.5)  # several connects refused, one each retry_s (1 s)
        assert (log.sent, log.buffered, log.dropped, log.idempotence) == (0, 10, 0, True)
        await log.close(timeout_s=0.5)
    assert (log.sent, log.buffered, log.dropped) == (0, 0, 10)
    assert registry.get_sample_value("tokenyard_audit_kafka_dropped_total") == 10
    assert registry.get_sample_value("tokenyard_audit_kafka_buffered") == 0
    lines = [(r.levelno, r.getMessage()) for r in caplog.records]
    refused = [(level, text) for level, text in lines if REFUSED in text]
    assert len(refused) == 1, lines  # one error line a minute, not one per attempt
    level, text = refused[0]
    assert level == logging.ERROR and "audit_kafka_idempotent = true requires" in text
    assert any("10 entries not delivered" in text for _, text in lines)


def cli(*args: str) -> list[dict[str, object]]:
    done = subprocess.run(
        [sys.executable, "-m", "tokenyard", "audit", *args],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


async def test_replay_cli_applies_the_exports_filters(
    make_backend: BackendFactory, tansu: Tansu
) -> None:
    url = tansu.url(topic())
    broker = make_backend(audit_kafka=url, **KAFKA)
    await run_jobs(broker)
    other = msgspec.structs.replace(job(tenant="acme"), id=new_job_id("other"), model="other")
    await broker.queue.enqueue(other)
    assert broker.audit_log is not None
    deadline = time.monotonic() + 20  # the dead letter's entry is held up to HOLD_S
    while broker.audit_log.sent < 8 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert broker.audit_log.sent == 8

    def both(*filters: str) -> tuple[list[dict[str, object]], list[dict[str, object]]]:
        from_kafka = cli("--from", url, *filters)
        from_broker = cli("--broker", make_backend.url, "--prefix", make_backend.prefix, *filters)
        return from_kafka, from_broker

    everything, expected = both("--since", "10m")
    assert len(everything) == 8
    # the same lines as the broker's export (both oldest first; equal stamps in either order)
    assert sorted(map(json.dumps, everything)) == sorted(map(json.dumps, expected))
    assert [e["at"] for e in everything] == sorted(e["at"] for e in everything)
    acme, expected = both("--since", "10m", "--tenant", "acme")
    assert {e["tenant"] for e in acme} == {"acme"} and len(acme) == 6
    assert sorted(map(json.dumps, acme)) == sorted(map(json.dumps, expected))
    only, _ = both("--since", "1h", "--model", "other")
    assert [(e["model"], e["status"]) for e in only] == [("other", "queued")]
    assert cli("--from", url, "--since", str(time.time() + 3600)) == []
    assert cli("--from", url, "--since", "1h", "--tenant", "nobody") == []


def test_replay_cli_refuses_in_one_line() -> None:
    port = free_port()
    for url, said in ((f"kafka://127.0.0.1:{port}", "kafka://host:9092/topic"),
                      (f"kafka://127.0.0.1:{port}/t", "cannot reach Kafka")):  # fmt: skip
        done = subprocess.run(
            [sys.executable, "-m", "tokenyard", "audit", "--since", "1h", "--from", url],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode != 0 and said in done.stderr, done.stderr
        assert "Traceback" not in done.stderr


@pytest.mark.slow
async def test_kafka_away_then_back_loses_nothing(
    make_backend: BackendFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    name = topic()
    caplog.set_level(logging.WARNING, logger="tokenyard.broker.kafka")
    with Tansu(tmp_path / "tansu.log") as kafka:
        broker = make_backend(audit_kafka=kafka.url(name), **KAFKA)
        log = broker.audit_log
        assert log is not None
        await broker.queue.enqueue(job(tenant="before"))
        deadline = time.monotonic() + 10
        while log.sent < 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert log.sent == 1
        kafka.pause()
        try:
            # the request path does not wait on Kafka: each enqueue stays a broker round trip
            slowest = 0.0
            for _ in range(30):
                began = time.perf_counter()
                assert (await broker.queue.enqueue(job(tenant="outage"))).created
                slowest = max(slowest, time.perf_counter() - began)
            assert slowest < 0.25
            await asyncio.sleep(12)  # past the producer's request timeout: it gives up, retries
            assert log.buffered == 30 and log.sent == 1
        finally:
            kafka.resume()
        deadline = time.monotonic() + 40
        while log.sent < 31 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert log.sent >= 31 and log.buffered == 0 and log.dropped == 0
        got = entries_of(await fetch(kafka.servers, name, 31))
        outage = {e.job_id for key, e in got if key == b"outage"}
        assert len(outage) == 30  # at least once: a batch resent after the outage may repeat
    # connected twice (before and after the outage); the refusal was asked and said once
    assert sum(REFUSED in r.getMessage() for r in caplog.records) == 1


async def test_a_full_buffer_drops_counts_and_logs(
    make_backend: BackendFactory, caplog: pytest.LogCaptureFixture
) -> None:
    nobody = f"kafka://127.0.0.1:{free_port()}/{topic()}"
    broker = make_backend(audit_kafka=nobody, audit_kafka_buffer=5, **KAFKA)
    log = broker.audit_log
    assert log is not None
    registry = CollectorRegistry()
    log.observe(AuditLogMetrics("tokenyard", registry))
    with caplog.at_level(logging.ERROR, logger="tokenyard.broker.kafka"):
        began = time.perf_counter()
        for _ in range(20):
            assert (await broker.queue.enqueue(job(tenant="t"))).created
        elapsed = time.perf_counter() - began
    assert elapsed < 2.0  # no enqueue waited for Kafka
    assert (log.buffered, log.dropped, log.sent) == (5, 15, 0)
    assert registry.get_sample_value("tokenyard_audit_kafka_dropped_total") == 15
    assert registry.get_sample_value("tokenyard_audit_kafka_sent_total") == 0
    lines = [r.getMessage() for r in caplog.records if "dropping" in r.getMessage()]
    assert len(lines) == 1 and "5 entries wait" in lines[0]  # one line, not one per entry
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="tokenyard.broker.kafka"):
        await log.close(timeout_s=0.2)  # what it still holds is counted and said
        assert (await broker.queue.enqueue(job(tenant="t"))).created  # and what comes after
    assert (log.buffered, log.dropped, log.sent) == (0, 21, 0)
    assert registry.get_sample_value("tokenyard_audit_kafka_dropped_total") == 21
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "5 entries not delivered" in lines[0] and "20 dropped in all" in lines[0]
    assert "closed, dropping new entries" in lines[1]


def test_the_url_names_servers_and_one_topic() -> None:
    target = KafkaTarget.parse("kafka://a:9092,b:9093/audit")
    assert (target.servers, target.topic, str(target)) == (
        "a:9092,b:9093",
        "audit",
        "kafka://a:9092,b:9093/audit",
    )
    for bad in ("kafka://a:9092", "kafka:///t", "redis://a/t", "kafka://a:9092/t/u"):
        with pytest.raises(FatalError):
            KafkaTarget.parse(bad)
    sink = KafkaAuditLog(target)  # idempotence asked for, kept where the broker grants it
    assert (sink.idempotent, sink.idempotence) == ("auto", None)
    assert (
        KafkaAuditLog(target, idempotent=False).idempotence,
        KafkaAuditLog(target, idempotent=True).idempotence,
    ) == (False, True)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_serve_sends_the_gateways_and_workers_entries(tansu: Tansu, tmp_path: Path) -> None:
    """`serve --audit-kafka`: the gateway writes the receipt, the worker the end; both reach
    the topic, and /metrics counts both processes' sends."""
    url, port = tansu.url(topic()), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENYARD_")}
    env |= {"TOKENYARD_WORKER_ENGINE": "sim"}
    with Processes(tmp_path) as procs:
        serve = procs.start(
            "serve",
            tokenyard_command("serve", "--port", str(port), "--data-dir", str(tmp_path / "v"),
                              "--audit-kafka", url),
            env=env, cwd=tmp_path,
        )  # fmt: skip
        base = f"http://127.0.0.1:{port}"
        wait_ready(base + "/readyz", procs, timeout_s=120, interval_s=0.2)
        reply = httpx.post(
            base + "/v1/completions",
            json={"model": "tiny", "prompt": "hi", "max_tokens": 4},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        sent: dict[str, float] = {}
        deadline = time.monotonic() + 20
        while (len(sent) < 2 or min(sent.values()) < 1) and time.monotonic() < deadline:
            time.sleep(0.2)
            sent = {
                name: float(value)
                for line in httpx.get(base + "/metrics").text.splitlines()
                for name, _, value in [line.partition(" ")]
                if name.endswith("audit_kafka_sent_total")
            }
        assert sent == {
            "tokenyard_audit_kafka_sent_total": 1.0,  # the gateway: the receipt
            "tokenyard_worker_audit_kafka_sent_total": 1.0,  # the worker: the end
        }
        serve.send_signal(signal.SIGINT)
        assert serve.wait(60) == 0
    replayed = cli("--from", url, "--since", "1h")
    assert [(e["event"], e["status"]) for e in replayed] == [
        ("received", "queued"),
        ("terminal", "succeeded"),
    ]
