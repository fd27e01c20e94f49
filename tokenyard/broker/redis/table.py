"""The Valkey job table: records (one hash per job), events (one stream per job), cancellation,
dead letters, and each ended job's quota settlement and audit entry.

Lanes leave these to it: Redis Streams lanes (queue.py) and RabbitMQ lanes (amqp/) both keep
their jobs here, and change them through their own fenced Lua scripts, which the table runs
with the audit entries' XADDs in the same round trip (`eval_audited`).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

from tokenyard.broker import audit
from tokenyard.broker.audit import AuditEntry
from tokenyard.broker.core import (
    BrokerStats,
    CancelOutcome,
    Clock,
    JobTable,
    LaneStats,
    Lease,
    Preempted,
    preempted_of,
)
from tokenyard.broker.outcomes import cancelled_result, expired_result
from tokenyard.broker.redis import scripts
from tokenyard.broker.redis.channel import Command
from tokenyard.broker.redis.connection import (
    MAX_BLOCK_S,
    SOCKET_TIMEOUT_S,
    RedisConnection,
    ms,
    text,
    xread_command,
)
from tokenyard.broker.redis.keys import Keys
from tokenyard.broker.redis.scripts import Call
from tokenyard.broker.redis.tables import RedisAudit, RedisQuotas
from tokenyard.broker.tables import settlement
from tokenyard.config import BrokerSettings
from tokenyard.errors import QueueFull
from tokenyard.messages import (
    DeadLetter,
    Finished,
    JobEvent,
    JobRecord,
    JobResult,
    JobSpec,
    JobStatus,
    Priority,
    TokenChunk,
    decode,
    decode_event,
    encode,
)

# one model's fenced completion: its jobs (lease, result, last chunk) and the time, as a script
CompleteCall = Callable[[str, Sequence[tuple[Lease, JobResult, TokenChunk | None]], str], Call]


def _field(fields: Any, name: bytes) -> Any:
    """A stream entry's field from its raw reply: a flat [name, value, ...] list (RESP2) or
    a map (RESP3)."""
    if isinstance(fields, dict):
        return fields[name]
    for i in range(0, len(fields), 2):
        if fields[i] == name:
            return fields[i + 1]
    raise KeyError(name)


def completion_args(
    lease: Lease, result: JobResult, tail: TokenChunk | None
) -> scripts.CompleteItemArgs:
    """A completion's per-item arguments, as both lane kinds' complete scripts take them: the
    holder (consumer, lease token), the job, its status, its Finished event and the tokens it
    ends with."""
    return scripts.CompleteItemArgs(
        lease.consumer,
        lease.entry_id,
        lease.spec.id,
        result.status.value,
        encode(Finished(result=result)),
        b"" if tail is None else encode(tail),
    )


class ValkeyJobTable(JobTable):
    """Jobs' records, events and cancellation on Valkey/Redis, for any lanes."""

    def __init__(
        self,
        settings: BrokerSettings,
        conn: RedisConnection,
        keys: Keys,
        quotas: RedisQuotas,
        audit_trail: RedisAudit,
        clock: Clock = time.time,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.conn = conn
        self.keys = keys
        self.quotas = quotas
        self.audit = audit_trail
        # the ends the scripts write as a job's Finished event; encoded once, not per call
        self.expired = encode(Finished(result=expired_result()))
        self.cancelled_event = encode(Finished(result=cancelled_result()))
        self._known_models: set[str] = set()

    @property
    def ttl_ms(self) -> int:
        """How long a finished job's record and events are kept."""
        return ms(self.settings.record_ttl_s)

    # -- running scripts -------------------------------------------------------------------
    async def eval_audited(
        self, calls: Sequence[Call], entries: Sequence[AuditEntry]
    ) -> tuple[list[Any], list[str | None]]:
        """Scripts with the audit entries' XADDs in the same round trip (the stream has its own
        hash tag, so it cannot be in the scripts). Returns the scripts' results and each
        entry's stream id (None where it was not written)."""
        appends = self.audit.appends(entries)
        if not appends:
            return await self.conn.eval_many(calls), [None] * len(entries)
        results, replies = await self.conn.eval_with(calls, appends)
        return results, self.audit.written(entries, replies)

    async def per_model(
        self, models: Sequence[str], call: Callable[[list[int]], Call]
    ) -> list[tuple[list[int], Any]]:
        """One script call per model, pipelined: a script's keys must share one hash slot."""
        batches: dict[str, list[int]] = defaultdict(list)
        for index, model in enumerate(models):
            batches[model].append(index)
        replies = await self.conn.eval_many([call(batch) for batch in batches.values()])
        return list(zip(batches.values(), replies, strict=True))

    async def codes_per_model(
        self, models: Sequence[str], call: Callable[[list[int]], Call]
    ) -> list[int]:
        """`per_model`, for scripts that answer one integer per item: those integers in order."""
        codes = [0] * len(models)
        for batch, reply in await self.per_model(models, call):
            for i, code in zip(batch, reply, strict=True):
                codes[i] = int(code)
        return codes

    async def flags_per_model(
        self, models: Sequence[str], call: Callable[[list[int]], Call]
    ) -> list[bool]:
        return [bool(code) for code in await self.codes_per_model(models, call)]

    async def emit_per_model(
        self,
        events: Sequence[tuple[Lease, JobEvent]],
        call: Callable[[list[tuple[Lease, JobEvent]]], Call],
    ) -> list[bool]:
        """`flags_per_model` for the leases' events: `call` gets one model's (lease, event)
        pairs; whether each event was appended (its lease still held)."""
        models = [lease.spec.model for lease, _ in events]
        return await self.flags_per_model(models, lambda batch: call([events[i] for i in batch]))

    # -- admission -------------------------------------------------------------------------
    async def note_models(self, models: Iterable[str]) -> None:
        """Add models this process has not enqueued for yet to the set `models()` reads."""
        new_models = set(models) - self._known_models
        if new_models:
            await self.conn.one(("SADD", self.keys.models(), *new_models))
            self._known_models |= new_models

    def lane_full(
        self, specs: Sequence[JobSpec], indexes: Sequence[int], refusal: Any
    ) -> QueueFull:
        """The QueueFull an enqueue script's `{item, depth}` refusal stands for."""
        item, depth = refusal
        full = specs[indexes[int(item) - 1]]
        lane = f"{full.model}/{full.priority.name.lower()}"
        return QueueFull(lane, int(depth), self.settings.max_queue_depth)

    def admission_keys(self, spec: JobSpec) -> tuple[str, str, str]:
        """A job's record, idempotency and in-flight keys (the job's own key stands in for
        those it has no key for: lib/admit.lua reads them only when the job asks)."""
        job = self.keys.job(spec.id)
        idem = inflight = job
        if spec.idempotency_key:
            idem = self.keys.idempotency(spec.model, spec.tenant, spec.idempotency_key)
        if spec.collapse_key:
            inflight = self.keys.inflight(spec.model, spec.collapse_key)
        return job, idem, inflight

    @staticmethod
    def admission(spec: JobSpec) -> scripts.Admission:
        """The job as every admitting script's item starts (enqueue.lua, amqp/lua/admit.lua)."""
        return scripts.Admission(
            job_id=spec.id,
            spec=encode(spec),
            deadline="" if spec.deadline is None else repr(spec.deadline),
            use_idem="1" if spec.idempotency_key else "0",
            use_inflight="1" if spec.collapse_key else "0",
        )

    # -- endings ---------------------------------------------------------------------------
    def completion_keys(self, model: str) -> scripts.CompleteKeys:
        """The model's keys both lane kinds' complete scripts write (lua/lib/ends.lua)."""
        return scripts.CompleteKeys(
            cancels=self.keys.cancels(model), counters=self.keys.counters(model)
        )

    async def complete_many(
        self,
        items: Sequence[tuple[Lease, JobResult]],
        tails: Sequence[TokenChunk | None] | None,
        call: CompleteCall,
        then: Callable[[Sequence[Lease]], Awaitable[None]] | None = None,
    ) -> list[bool]:
        """One fenced completion script per model (`call` builds it), the terminal audit
        entries in the same round trip; `then` lets the lanes drop the deliveries (accepted or
        fenced); then the quotas of the accepted ones are settled."""
        if not items:
            return []
        now = repr(self.clock())
        by_model: dict[str, list[int]] = defaultdict(list)
        for index, (lease, _) in enumerate(items):
            by_model[lease.spec.model].append(index)
        calls = [
            call(model, [(*items[i], None if tails is None else tails[i]) for i in indexes], now)
            for model, indexes in by_model.items()
        ]
        accepted = [False] * len(items)
        when = self.clock()
        entries = [audit.terminal(lease.spec, result, when) for lease, result in items]
        replies, ids = await self.eval_audited(calls, entries)
        for indexes, flags in zip(by_model.values(), replies, strict=True):
            for i, flag in zip(indexes, flags, strict=True):
                accepted[i] = bool(flag)
        await self.audit.take_back([ids[i] for i in range(len(items)) if not accepted[i]])
        if then is not None:
            await then([lease for lease, _ in items])
        await self.settle(
            [(items[i][0].spec, items[i][1]) for i in range(len(items)) if accepted[i]],
            audited=False,
        )
        return accepted

    async def settle(
        self, ended: Sequence[tuple[JobSpec, JobResult | None]], audited: bool = True
    ) -> None:
        """Settle jobs that just ended and, unless their path wrote it already, audit their
        end: one round trip for both (the terminal entry rides with the settlement)."""
        held = [settlement(spec, result) for spec, result in ended if spec.quota]
        now = self.clock()
        entries = (
            [audit.terminal(spec, result, now) for spec, result in ended if result is not None]
            if audited
            else []
        )
        if held or entries:
            await self.eval_audited(self.quotas.settle_calls(held) if held else [], entries)

    async def preempted(self, leases: Sequence[Lease], codes: Sequence[int]) -> list[Preempted]:
        """What a preemption did to each of `leases` (core.preempted_of: release codes 1
        requeued, 2 cancelled, else refused), each requeued job's audit entry written after its
        requeue, as the lanes' own scripts cannot hold the audit stream's XADD."""
        now = self.clock()
        await self.audit.write(
            [audit.preempted(x.spec, now) for x, c in zip(leases, codes, strict=True) if c == 1]
        )
        return [preempted_of(code) for code in codes]

    async def settle_ids(self, job_ids: Sequence[str]) -> None:
        """Settle jobs that just ended where only their ids are at hand (rare paths)."""
        records = [await self.record(job_id) for job_id in job_ids]
        await self.settle([(r.spec, r.result) for r in records if r is not None])

    # -- liveness --------------------------------------------------------------------------
    async def beat(self, model: str, consumer: str) -> None:
        """The worker lives until `liveness_s` from now (the lanes' reaps read the set)."""
        until = self.clock() + self.settings.liveness_s
        await self.conn.one(("ZADD", self.keys.live(model), repr(until), consumer))

    # -- cancellation ----------------------------------------------------------------------
    async def cancel(self, job_id: str) -> CancelOutcome:
        return await self._cancel(job_id, 0)

    async def leave(self, job_id: str, followers: int = 1) -> CancelOutcome:
        return await self._cancel(job_id, max(1, followers))

    async def _cancel(self, job_id: str, leaving: int) -> CancelOutcome:
        keys = self.keys
        call = scripts.CANCEL.call(
            scripts.CancelKeys(
                job=keys.job(job_id),
                events=keys.events(job_id),
                cancels=keys.cancels_of_job(job_id),
                delayed=keys.delayed_of_job(job_id),
            ),
            scripts.CancelArgs(
                job_id=job_id,
                now=repr(self.clock()),
                finished=encode(Finished(result=cancelled_result())),
                ttl_ms=self.ttl_ms,
                leaving=leaving,
            ),
        )
        outcome = CancelOutcome(text(await self.conn.run(call)))
        if outcome is CancelOutcome.CANCELLED:
            await self.settle_ids([job_id])
        return outcome

    async def cancelled(self, model: str, job_ids: Sequence[str]) -> set[str]:
        if not job_ids:
            return set()
        # the set holds only jobs someone asked to cancel, so it is small; fetching it costs less
        # than sending every running id. A raw command on the broker's own connections: a busy
        # worker asks every poll, and redis-py's client path was ~2 % of its CPU
        members = await self.conn.one(("SMEMBERS", self.keys.cancels(model)))
        return {text(m) for m in members} & set(job_ids)

    # -- events and records ----------------------------------------------------------------
    async def read_events(
        self, job_id: str, after: str = "0", block_s: float = 0.0, count: int = 1000
    ) -> list[tuple[str, JobEvent]]:
        found = await self._read_streams({self.keys.events(job_id): after}, count, block_s)
        return [(eid, event) for _, eid, event in found]

    async def read_events_many(
        self, cursors: Mapping[str, str], block_s: float = 0.0, count: int = 1000
    ) -> list[tuple[str, str, JobEvent]]:
        if not cursors:
            return []
        job_of = {self.keys.events(job_id): job_id for job_id in cursors}
        found = await self._read_streams(
            {key: cursors[job_id] for key, job_id in job_of.items()}, count, block_s
        )
        return [(job_of[key], eid, event) for key, eid, event in found]

    async def _read_streams(
        self, cursors: Mapping[str, str], count: int, block_s: float
    ) -> list[tuple[str, str, JobEvent]]:
        """XREAD of event streams as (stream key, event id, event), parsed from the raw reply."""
        block = min(block_s, MAX_BLOCK_S) if block_s > 0 else None
        command = xread_command({key: after or "0" for key, after in cursors.items()}, count, block)
        (reply,) = await self.conn.checked([command], timeout_s=(block or 0) + SOCKET_TIMEOUT_S)
        # RESP2 answers a list of [key, entries], RESP3 a map of key -> entries
        streams = reply.items() if isinstance(reply, dict) else (reply or ())
        out: list[tuple[str, str, JobEvent]] = []
        for key, entries in streams:
            name = text(key)
            for eid, fields in entries:
                out.append((name, text(eid), decode_event(_field(fields, b"e"))))
        return out

    async def record(self, job_id: str) -> JobRecord | None:
        h: dict[bytes, bytes] = await self.conn.parsed("HGETALL", self.keys.job(job_id))
        return _record_of_hash(h)

    async def records(self, job_ids: Sequence[str]) -> list[JobRecord | None]:
        pipe = self.conn.pipeline()
        for job_id in job_ids:
            pipe.hgetall(self.keys.job(job_id))
        return [_record_of_hash(h) for h in await self.conn.execute(pipe)] if job_ids else []

    # -- introspection ---------------------------------------------------------------------
    def tally_commands(self, model: str) -> list[Command]:
        """What `stats_of` reads besides the lanes: the jobs waiting out a backoff, the dead
        letters, the counters (fenced completions, expiries)."""
        return [
            ("ZCARD", self.keys.delayed(model)),
            ("XLEN", self.keys.dead_letters(model)),
            ("HGETALL", self.keys.counters(model)),
        ]

    def stats_of(self, model: str, lanes: list[LaneStats], tallies: Sequence[Any]) -> BrokerStats:
        """A model's stats from its lanes' and the replies to `tally_commands`."""
        for reply in tallies:
            if isinstance(reply, Exception):
                raise reply
        delayed, dead, counters = tallies
        # a map (RESP3, or redis-py's parsing) or a flat [name, value, ...] list (RESP2)
        counts = (
            {text(k): v for k, v in counters.items()}
            if isinstance(counters, dict)
            else dict(zip(map(text, counters[::2]), counters[1::2], strict=True))
        )
        return BrokerStats(
            model=model,
            lanes=lanes,
            delayed=int(delayed),
            dead_letters=int(dead),
            fenced_completions=int(counts.get("fenced", 0)),
            expired=int(counts.get("expired", 0)),
        )

    async def dead_letters(self, model: str, count: int = 100) -> list[DeadLetter]:
        rows: list[tuple[bytes, dict[bytes, bytes]]] = await self.conn.parsed(
            "XRANGE", self.keys.dead_letters(model), "-", "+", "COUNT", count
        )
        out = []
        for _, f in rows:
            out.append(
                DeadLetter(
                    job_id=text(f[b"job"]),
                    model=model,
                    priority=Priority[text(f[b"priority"])],
                    reason=text(f[b"reason"]),
                    error=text(f[b"error"]) if f.get(b"error") else None,
                    deliveries=int(f[b"deliveries"]),
                    at=float(f[b"at"]),
                )
            )
        return out

    async def models(self) -> list[str]:
        members: set[bytes] = await self.conn.parsed("SMEMBERS", self.keys.models())
        return sorted(text(m) for m in members)


def _record_of_hash(h: Any) -> JobRecord | None:
    """A job record from its hash (HGETALL's reply); None when the job is unknown."""
    if not h or b"spec" not in h:
        return None
    spec = decode(h[b"spec"], JobSpec)
    deliveries = int(h.get(b"deliveries", b"0"))
    spec.attempt = max(0, deliveries - 1)

    def opt_float(field: bytes) -> float | None:
        raw = h.get(field)
        return float(raw) if raw else None

    return JobRecord(
        spec=spec,
        status=JobStatus(text(h[b"status"])),
        deliveries=deliveries,
        enqueued_at=float(h.get(b"enq_at", b"0")),
        started_at=opt_float(b"start_at"),
        finished_at=opt_float(b"end_at"),
        worker=text(h[b"worker"]) if b"worker" in h else None,
        last_error=text(h[b"last_error"]) if b"last_error" in h else None,
        cancel_requested=h.get(b"cancel") == b"1",
        preemptions=int(h.get(b"preempted", b"0")),
        # the stored result is the job's Finished event (see complete.lua)
        result=decode(h[b"result"], Finished).result if b"result" in h else None,
    )


class OnTable:
    """A part of lanes over the Valkey job table (Redis Streams' counts, RabbitMQ's ledger):
    on the table's server, under its keys."""

    def __init__(self, table: ValkeyJobTable) -> None:
        self.table = table
        self.settings = table.settings
        self.clock = table.clock
        self.conn = table.conn
        self.keys = table.keys
