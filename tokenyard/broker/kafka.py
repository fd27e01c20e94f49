"""The Kafka audit log (aiokafka): a sink that mirrors the audit trail to a topic, and its replay.

The sink stays off the request's path: `offer` appends to a bounded in-process buffer and
returns; one background task produces (acks=all, keyed by tenant, in record batches of what
arrived within the linger; idempotent where the broker grants a producer id, see `_connect`).
Entries leave the buffer only once Kafka acknowledged them, so an outage the buffer spans
loses nothing (at-least-once: a batch sent again after a failure may arrive twice); an entry
that never reaches Kafka (offered past the buffer or after close, or still waiting when close
gives up) is counted (`dropped`, the metric) and logged, rate-limited.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections import deque
from collections.abc import Sequence
from itertools import islice
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from tokenyard.broker import audit
from tokenyard.broker.audit import AuditEntry, AuditSink, Mirrored
from tokenyard.errors import FatalError

if TYPE_CHECKING:
    from tokenyard.broker import Backend
    from tokenyard.config import BrokerSettings
    from tokenyard.metrics import AuditLogMetrics

log = logging.getLogger(__name__)
# aiokafka logs an error for every failed connection attempt, each second of an outage; this
# module says once when Kafka goes away and once when it is back
logging.getLogger("aiokafka").setLevel(logging.CRITICAL)

SCHEME = "kafka://"
_DROP_LOG_EVERY_S = 10.0  # while dropping: one line at the start, then one this often
_REFUSED_LOG_EVERY_S = 60.0  # idempotence required and refused: one error line this often


class IdempotenceRefused(Exception):
    """The broker refused the idempotent producer that `audit_kafka_idempotent = true` asks."""


class KafkaTarget(msgspec.Struct, frozen=True):
    """A topic on a Kafka cluster: `kafka://host:port[,host:port...]/topic`."""

    servers: str
    topic: str

    @classmethod
    def parse(cls, url: str) -> KafkaTarget:
        rest = url[len(SCHEME) :] if url.startswith(SCHEME) else None
        servers, _, topic = (rest or "").partition("/")
        topic = topic.strip("/")
        if rest is None or not servers or not topic or "/" in topic:
            raise FatalError(f"Kafka audit log {url!r}: expected kafka://host:9092/topic")
        return cls(servers, topic)

    def __str__(self) -> str:
        return f"{SCHEME}{self.servers}/{self.topic}"


@functools.cache
def _aiokafka() -> Any:
    try:
        import aiokafka
        import aiokafka.partitioner
    except ImportError as exc:
        raise FatalError(
            "the Kafka audit log needs aiokafka: pip install 'tokenyard[kafka]'"
        ) from exc
    return aiokafka


class KafkaAuditLog(AuditSink):
    """Produces the audit entries offered to it to one topic, from a background task."""

    def __init__(
        self,
        target: KafkaTarget,
        buffer: int = 100_000,
        linger_ms: int = 20,
        idempotent: bool | Literal["auto"] = "auto",
        batch: int = 2000,
        retry_s: float = 1.0,
    ) -> None:
        self.target = target
        self.capacity = max(1, buffer)
        self.linger_ms = linger_ms
        self.idempotent = idempotent  # the setting: "auto" | True (required) | False (off)
        # what the producer does: None until a connect decided it ("auto")
        self.idempotence: bool | None = None if idempotent == "auto" else idempotent
        self.batch = batch
        self.retry_s = retry_s
        self.sent = 0  # entries Kafka acknowledged
        self.dropped = 0  # entries that never reached Kafka: buffer full, closed, shutdown
        self.metrics: AuditLogMetrics | None = None
        self._buffer: deque[AuditEntry] = deque()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._outage = False
        self._refused_logged_at: float | None = None
        self._dropping_since: float | None = None
        self._drop_logged_at = 0.0
        self._encode = msgspec.json.Encoder().encode
        _aiokafka()  # refuse at once, not at the first entry, where aiokafka is missing

    @classmethod
    def from_settings(cls, settings: BrokerSettings) -> KafkaAuditLog:
        return cls(
            KafkaTarget.parse(settings.audit_kafka),
            buffer=settings.audit_kafka_buffer,
            linger_ms=settings.audit_kafka_linger_ms,
            idempotent=settings.audit_kafka_idempotent,
        )

    @property
    def buffered(self) -> int:
        """Entries offered and not yet acknowledged by Kafka."""
        return len(self._buffer)

    def observe(self, metrics: AuditLogMetrics) -> None:
        """Count into `metrics` from now on (what was counted before is added at once)."""
        metrics.sent.inc(self.sent)
        metrics.dropped.inc(self.dropped)
        metrics.buffered.set(self.buffered)
        self.metrics = metrics

    def offer(self, entries: Sequence[AuditEntry]) -> None:
        room = self.capacity - len(self._buffer) if not self._closing else 0
        self._buffer.extend(entries[: max(0, room)])
        if len(entries) > room:
            self._drop(len(entries) - max(0, room))
        if self._task is None and not self._closing:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="audit-kafka")
        self._wake.set()

    def _count_dropped(self, count: int) -> None:
        self.dropped += count
        if self.metrics is not None:
            self.metrics.dropped.inc(count)

    def _drop(self, count: int) -> None:
        self._count_dropped(count)
        now = time.monotonic()
        if self._dropping_since is None or now - self._drop_logged_at >= _DROP_LOG_EVERY_S:
            first = self._dropping_since is None
            self._dropping_since = self._dropping_since or now
            self._drop_logged_at = now
            why = "closed" if self._closing else "buffer full"
            log.error(
                "audit log: %s; %d entries wait for %s, %d dropped so far",
                f"{why}, dropping new entries" if first else f"{why}, still dropping",
                len(self._buffer),
                self.target,
                self.dropped,
            )

    async def close(self, timeout_s: float = 5.0) -> None:
        """Deliver what the buffer holds, for at most `timeout_s`; then stop. What is left is
        counted as dropped and said."""
        self._closing = True
        self._wake.set()
        if self._task is not None and not self._task.done():
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout_s)
            except TimeoutError:
                self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)
        if self._buffer:
            left = len(self._buffer)
            self._buffer.clear()
            self._count_dropped(left)
            log.error(
                "audit log: %d entries not delivered to %s at shutdown; %d dropped in all",
                left,
                self.target,
                self.dropped,
            )
        self._dropping_since = None  # an entry offered from now on is said anew: "closed"
        if self.metrics is not None:
            self.metrics.buffered.set(0)

    def _producer(self, idempotent: bool) -> Any:
        return _aiokafka().AIOKafkaProducer(
            bootstrap_servers=self.target.servers.split(","),
            acks="all",
            enable_idempotence=idempotent,
            linger_ms=0,  # `_run` lingers and hands it whole record batches
            max_batch_size=256 * 1024,
            request_timeout_ms=10_000,
            client_id="tokenyard-audit",
        )

    async def _connect(self) -> Any:
        """A started producer: idempotent unless the setting turned it off or ("auto") the
        broker refused it.

        An idempotent producer asks for a producer id (InitProducerId v0) as it starts; the
        broker's ApiVersions cannot tell whether it will get one (Tansu 0.6 lists v0-v5, then
        its memory engine answers UNKNOWN; Kafka answers CLUSTER_AUTHORIZATION_FAILED where
        the client may not IdempotentWrite), so the answer decides. A refusal ("auto"): acks=
        all alone from then on, said once; `true` raises `IdempotenceRefused` instead."""
        idempotent = self.idempotence is not False
        try:
            producer = await _started(self._producer(idempotent))
        except Exception as exc:
            if not idempotent or not _refusal(exc):
                raise
            if self.idempotent is True:
                raise IdempotenceRefused(
                    f"{self.target} refuses the idempotent producer ({exc!r}) that "
                    "audit_kafka_idempotent = true requires; nothing is sent (set it to auto "
                    "or false)"
                ) from exc
            self.idempotence = False
            log.warning(
                "audit log: %s refuses the idempotent producer (%r); producing with acks=all "
                "without it, so an entry resent after an error may arrive twice (drop repeats "
                "by job_id + event)",
                self.target,
                exc,
            )
            return await _started(self._producer(False))
        self.idempotence = idempotent
        return producer

    async def _run(self) -> None:
        producer: Any = None
        try:
            while True:
                if not self._buffer:
                    if self._closing:
                        return
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                if len(self._buffer) < self.batch and not self._closing:
                    # linger: entries that arrive meanwhile ride in the same record batches
                    await asyncio.sleep(self.linger_ms / 1000)
                batch = list(islice(self._buffer, self.batch))
                try:
                    if producer is None:
                        producer = await self._connect()
                    await self._send(producer, batch)
                except Exception as exc:  # the entries wait in the buffer whatever it was
                    self._down(exc)
                    await _stop(producer)
                    producer = None  # a new producer id: the old one's sequence broke off
                    await asyncio.sleep(self.retry_s)
                    continue
                for _ in batch:  # only this task pops; `offer` appends at the other end
                    self._buffer.popleft()
                self._delivered(len(batch))
        finally:
            await _stop(producer)

    async def _send(self, producer: Any, batch: list[AuditEntry]) -> None:
        """One record batch per partition (more where one fills), each entry on its tenant's
        partition by Kafka's default partitioner (murmur2 of the key); building the batches
        here costs a fraction of a `send` per entry."""
        partitioner = _aiokafka().partitioner.DefaultPartitioner()
        topic = self.target.topic
        partitions = sorted(await producer.partitions_for(topic))
        by_partition: dict[int, list[tuple[bytes, bytes]]] = {}
        for entry in batch:
            key = entry.tenant.encode()
            part = partitioner(key, partitions, partitions)
            by_partition.setdefault(part, []).append((key, self._encode(entry)))
        pending = []
        for part, records in by_partition.items():
            builder = producer.create_batch()
            for key, value in records:
                if builder.append(key=key, value=value, timestamp=None) is None:  # full
                    pending.append(await producer.send_batch(builder, topic, partition=part))
                    builder = producer.create_batch()
                    builder.append(key=key, value=value, timestamp=None)
            pending.append(await producer.send_batch(builder, topic, partition=part))
        outcomes = await asyncio.gather(*pending, return_exceptions=True)
        failed = next((o for o in outcomes if isinstance(o, BaseException)), None)
        if failed is not None:
            raise failed

    def _delivered(self, count: int) -> None:
        self.sent += count
        if self.metrics is not None:
            self.metrics.sent.inc(count)
            self.metrics.buffered.set(len(self._buffer))
        self._refused_logged_at = None
        if self._outage:
            self._outage = False
            log.warning(
                "audit log: %s takes entries again (%d waiting)", self.target, self.buffered
            )
        if self._dropping_since is not None and len(self._buffer) < self.capacity:
            log.warning("audit log: buffer has room again; %d dropped in all", self.dropped)
            self._dropping_since = None

    def _down(self, exc: BaseException) -> None:
        if self.metrics is not None:
            self.metrics.buffered.set(len(self._buffer))
        now = time.monotonic()
        if isinstance(exc, IdempotenceRefused):  # no outage that ends by itself: keep saying
            last = self._refused_logged_at
            if last is None or now - last >= _REFUSED_LOG_EVERY_S:
                self._refused_logged_at = now
                log.error("audit log: %s; %d entries wait", exc, len(self._buffer))
            self._outage = True
            return
        if not self._outage and not isinstance(
            exc, _aiokafka().errors.KafkaError | OSError | TimeoutError
        ):  # a fault of this module or aiokafka: the traceback says where
            self._outage = True
            log.error(
                "audit log: cannot produce to %s; entries wait in the buffer (%d of %d)",
                self.target,
                len(self._buffer),
                self.capacity,
                exc_info=exc,
            )
        if not self._outage:
            self._outage = True
            log.warning(
                "audit log: cannot produce to %s (%r); entries wait in the buffer (%d of %d)",
                self.target,
                exc,
                len(self._buffer),
                self.capacity,
            )


async def _started(producer: Any) -> Any:
    try:
        await producer.start()
    except BaseException:
        await _stop(producer)
        raise
    return producer


def _refusal(exc: Exception) -> bool:
    """Whether `exc`, raised by an idempotent producer's start, is the broker refusing the
    producer id rather than an outage (no connection, a timeout, an error worth retrying)."""
    errors = _aiokafka().errors
    if isinstance(exc, errors.KafkaConnectionError | errors.KafkaTimeoutError | OSError):
        return False
    return not isinstance(exc, TimeoutError) and not getattr(exc, "retriable", False)


async def _stop(producer: Any) -> None:
    if producer is None:
        return
    try:
        await asyncio.wait_for(producer.stop(), 5.0)
    except Exception as exc:  # it is being replaced or the process is ending: say, go on
        log.debug("audit log: producer stop: %r", exc)


def attach(backend: Backend) -> Backend:
    """`backend` with its audit trail mirrored to the Kafka topic its settings name."""
    if not isinstance(backend.audit, Mirrored):
        raise FatalError(f"the audit trail of {backend.settings.url} cannot go to Kafka")
    sink = KafkaAuditLog.from_settings(backend.settings)
    backend.audit.mirror_to(sink)
    return dataclasses.replace(backend, audit_log=sink)


async def _partitions(target: KafkaTarget, wait_s: float = 5.0) -> list[int]:
    """The topic's partitions ([] where there is no such topic), from metadata fetched now.

    A consumer's `partitions_for_topic` reads the metadata it cached at start, refreshed only
    every `metadata_max_age_ms` (5 min): a topic created meanwhile stays unknown to it. And a
    topic being created may be listed before its partitions are: wait for them a while."""
    client = _aiokafka().AIOKafkaClient(
        bootstrap_servers=target.servers.split(","), client_id="tokenyard-audit-replay"
    )
    try:
        await client.bootstrap()
        give_up = time.monotonic() + wait_s
        while True:
            cluster = await client.fetch_all_metadata()
            parts = cluster.partitions_for_topic(target.topic)
            if parts or target.topic not in cluster.topics() or time.monotonic() > give_up:
                return sorted(parts or ())
            await asyncio.sleep(0.1)
    finally:
        await client.close()


async def replay(
    url: str,
    since: float,
    tenant: str | None = None,
    model: str | None = None,
    idle_s: float = 1.0,
) -> list[AuditEntry]:
    """The topic's entries written at or after `since` matching the filters, oldest first.

    Reads every partition from its start until a fetch of `idle_s` brings nothing and each
    position passed the end offset seen at the start (Tansu counts a batch as one record in
    its end offsets, so those alone cannot say when the topic is read)."""
    target = KafkaTarget.parse(url)
    kafka = _aiokafka()
    try:
        parts = await _partitions(target)
    except (kafka.errors.KafkaError, OSError) as exc:
        raise FatalError(f"cannot reach Kafka at {target.servers}: {exc}") from exc
    if not parts:
        return []
    consumer = kafka.AIOKafkaConsumer(
        bootstrap_servers=target.servers.split(","),
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        client_id="tokenyard-audit-replay",
    )
    try:
        await consumer.start()
    except (kafka.errors.KafkaError, OSError) as exc:
        await _stop(consumer)
        raise FatalError(f"cannot reach Kafka at {target.servers}: {exc}") from exc
    found: list[AuditEntry] = []
    decoder = msgspec.json.Decoder(AuditEntry)
    try:
        tps = [kafka.TopicPartition(target.topic, p) for p in parts]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        bad = idle = 0
        while True:
            got = await consumer.getmany(timeout_ms=int(idle_s * 1000), max_records=10_000)
            for records in got.values():
                for record in records:
                    try:
                        entry = decoder.decode(record.value)
                    except msgspec.DecodeError:
                        bad += 1
                        continue
                    if audit.matches(entry, since, tenant, model):
                        found.append(entry)
            idle = 0 if got else idle + 1
            if idle:
                positions = [await consumer.position(tp) for tp in tps]
                done = all(pos >= ends[tp] for pos, tp in zip(positions, tps, strict=True))
                if done or idle >= 5:  # 5: offsets no record holds (transaction markers)
                    break
        if bad:
            log.warning("audit replay: %d records of %s are not audit entries", bad, target)
    finally:
        await _stop(consumer)
    found.sort(key=lambda e: e.at)  # per-partition order only: the export is by time
    return found
