"""Counts of the NATS queue: lanes' waiting and in-flight jobs, backlog by tenant, dead letters,
retries waiting, models.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import nats.js.errors

from tokenyard.broker.core import (
    BrokerStats,
    LaneBacklog,
    LaneStats,
    LaneWaiting,
    TenantBacklog,
)
from tokenyard.broker.nats.connection import sent
from tokenyard.broker.nats.names import Names
from tokenyard.broker.nats.store import Part
from tokenyard.messages import DeadLetter, JobSpec, Priority, decode


class Introspection(Part):
    """Stats, depth and backlog."""

    def _places(self) -> list[tuple[Priority, int]]:
        """Every lane of a model: (priority, pool), highest priority first."""
        return [(p, pool) for p in Priority for pool in range(self.settings.pool_count)]

    async def _lane_counts(
        self, model: str, places: Sequence[tuple[Priority, int]]
    ) -> list[tuple[Priority, int, dict[str, int], dict[str, Any]]]:
        """Per lane at `places`: (priority, pool, subject counts, consumers' info by
        subject)."""
        out = []
        for priority, pool in places:
            stream = await self.store.lane(model, priority, pool)
            subjects = await self.store.subjects(stream)
            infos = await self.store.consumer_infos(stream)
            out.append((priority, pool, subjects, infos))
        return out

    async def waiting(self, model: str, above: Priority, pools: Sequence[int]) -> list[LaneWaiting]:
        places = [(p, pool) for p in Priority if p < above for pool in pools]
        now = self.clock()
        rows = []
        for priority, pool, subjects, infos in await self._lane_counts(model, places):
            waiting, _ = _counts(subjects, infos)
            age = await self._oldest_age(model, priority, pool, now) if waiting else None
            rows.append((priority, waiting, age))
        return LaneWaiting.by_priority(rows)

    async def stats(self, model: str) -> BrokerStats:
        now = self.clock()
        waiting: dict[Priority, int] = defaultdict(int)
        in_flight: dict[Priority, int] = defaultdict(int)
        oldest: dict[Priority, float] = {}
        for priority, _, subjects, infos in await self._lane_counts(model, self._places()):
            lane_waiting, lane_in_flight = _counts(subjects, infos)
            waiting[priority] += lane_waiting
            in_flight[priority] += lane_in_flight
        delayed = await self._delayed(model)
        jobs = await self._waiting_ages(model, now)
        for priority, age in jobs.items():
            oldest[priority] = age
        lanes = [
            LaneStats(
                model,
                p,
                waiting=waiting[p],
                in_flight=in_flight[p],
                oldest_waiting_age_s=oldest.get(p) if waiting[p] else None,
            )
            for p in Priority
        ]
        dead = await self._dead_count(model)
        return BrokerStats(
            model=model,
            lanes=lanes,
            delayed=delayed,
            dead_letters=dead,
            fenced_completions=await self.store.counter(model, "fenced"),
            expired=await self.store.counter(model, "expired"),
        )

    async def _waiting_ages(self, model: str, now: float) -> dict[Priority, float]:
        """Per priority, the age of its oldest message (the first in each lane stream)."""
        out: dict[Priority, float] = {}
        for priority, pool in self._places():
            age = await self._oldest_age(model, priority, pool, now)
            if age is not None:
                out[priority] = max(out.get(priority, 0.0), age)
        return out

    async def _oldest_age(
        self, model: str, priority: Priority, pool: int, now: float
    ) -> float | None:
        """The age of the first message in a lane stream (None: the lane holds none)."""
        js = await self.conn.js()
        stream = self.names.lane_stream(model, priority, pool)
        try:
            info = await sent(js.stream_info(stream))
        except nats.js.errors.NotFoundError:
            return None
        if not info.state.messages:
            return None
        try:
            msg = await sent(js.get_msg(stream, info.state.first_seq))
        except nats.js.errors.NotFoundError:
            return None
        spec = decode(msg.data or b"", JobSpec)
        return max(0.0, now - spec.created_at)

    async def _delayed(self, model: str) -> int:
        return len(await self.store.marked(Names.delayed(model)))

    async def _dead_count(self, model: str) -> int:
        stream = await self.store.dead_stream()
        subjects = await self.store.subjects(stream)
        return int(subjects.get(self.names.dead(model), 0))

    async def depth(self, model: str) -> int:
        lanes = [(p, pool) for p in Priority for pool in range(self.settings.pool_count)]
        streams = await asyncio.gather(*(self.store.lane(model, p, pool) for p, pool in lanes))
        counts = await asyncio.gather(*(self._messages(s) for s in streams))
        return sum(counts)

    async def _messages(self, stream: str) -> int:
        """A lane's messages (waiting and in flight), from its state: no subject listed."""
        try:
            answer = await self.conn.api(f"STREAM.INFO.{stream}", {})
        except nats.js.errors.NotFoundError:
            return 0
        return int(answer.get("state", {}).get("messages", 0))

    async def backlog(self, model: str) -> list[LaneBacklog]:
        out = []
        per: dict[Priority, tuple[int, int, dict[str, TenantBacklog]]] = {}
        for priority, _, subjects, infos in await self._lane_counts(model, self._places()):
            queued, flying, tenants = per.get(priority, (0, 0, {}))
            for subject, n in subjects.items():
                info = infos.get(f"{subject}.*")
                pending = int(info.num_ack_pending) if info is not None else 0
                flying += pending
                waiting = max(0, n - pending)
                kind, _ = Names.subject_kind(subject)
                if kind != "t":
                    queued += waiting  # held for a worker; a tenant's are staged by tenant
                elif waiting > 0:
                    tenant, weight = await self._tenant_of(subject)
                    was = tenants.get(tenant)
                    tenants[tenant] = TenantBacklog(
                        tenant, waiting + (was.staged if was else 0), weight
                    )
            per[priority] = (queued, flying, tenants)
        for priority in Priority:
            queued, flying, tenants = per.get(priority, (0, 0, {}))
            out.append(LaneBacklog(priority, queued, flying, list(tenants.values())))
        return out

    async def _tenant_of(self, subject: str) -> tuple[str, float]:
        """A tenant subject's tenant name and weight, from its first message."""
        stream = self.names.stream_of_subject(subject)
        rows = await self.conn.get_batch(stream, f"{subject}.*", 0, 1)
        if not rows:
            return Names.subject_kind(subject)[1], 1.0
        spec = decode(rows[0][1], JobSpec)
        return spec.tenant, spec.weight

    async def dead_letters(self, model: str, count: int = 100) -> list[DeadLetter]:
        stream = await self.store.dead_stream()
        rows = await self.conn.get_batch(stream, self.names.dead(model), 0, count)
        return [decode(data, DeadLetter) for _, data, _ in rows]

    async def models(self) -> list[str]:
        return sorted(await self.store.marked(self.names.models_key))


def _counts(subjects: dict[str, int], infos: dict[str, Any]) -> tuple[int, int]:
    """A lane's (waiting, in flight) from its subjects' message counts and their consumers'
    pending acks."""
    waiting = in_flight = 0
    for subject, n in subjects.items():
        info = infos.get(f"{subject}.*")
        pending = int(info.num_ack_pending) if info is not None else 0
        in_flight += pending
        waiting += max(0, n - pending)
    return waiting, in_flight
