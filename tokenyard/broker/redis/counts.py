"""The Redis Streams lanes' counts: what waits and what runs in each lane (its stream and
consumer group, fair-share staging, prefix-affinity holds), with the job table's tallies."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenyard.broker.core import (
    BrokerStats,
    LaneBacklog,
    LaneStats,
    LaneWaiting,
    TenantBacklog,
)
from tokenyard.broker.redis.channel import Command
from tokenyard.broker.redis.connection import text
from tokenyard.broker.redis.keys import GROUP
from tokenyard.broker.redis.table import OnTable
from tokenyard.messages import Priority


class StreamCounts(OnTable):
    """`Stats` for Redis Streams lanes (depths, ages, backlog) over the job table's server."""

    async def stats(self, model: str) -> BrokerStats:
        """Two round trips: lane sizes, groups and counters; then each lane's oldest waiting."""
        pools = self.settings.pool_count
        places = [(p, pool) for p in Priority for pool in range(pools)]
        rows, tallies = await self._lane_rows(model, places, self.table.tally_commands(model))
        stats = []
        for p, priority in enumerate(Priority):
            mine = rows[p * pools : (p + 1) * pools]  # a priority's size pools together
            ages = [age for _, _, age in mine if age is not None]
            stats.append(
                LaneStats(
                    model,
                    priority,
                    waiting=sum(waiting for waiting, _, _ in mine),
                    in_flight=sum(running for _, running, _ in mine),
                    oldest_waiting_age_s=max(ages) if ages else None,
                )
            )
        return self.table.stats_of(model, stats, tallies)

    async def waiting(self, model: str, above: Priority, pools: Sequence[int]) -> list[LaneWaiting]:
        places = [(p, pool) for p in Priority if p < above for pool in pools]
        if not places:
            return []
        rows, _ = await self._lane_rows(model, places, [])
        return LaneWaiting.by_priority(
            (p, waiting, age) for (p, _), (waiting, _, age) in zip(places, rows, strict=True)
        )

    async def _lane_rows(
        self, model: str, places: Sequence[tuple[Priority, int]], extra: list[Command]
    ) -> tuple[list[tuple[int, int, float | None]], list[Any]]:
        """Each lane's (waiting, in flight, oldest waiting age) at `places` (priority, pool),
        and the replies to `extra`, sent with the first of the two round trips."""
        now = self.clock()
        lanes = [self.keys.lane(model, p, pool) for p, pool in places]
        commands = self._lanes_read(lanes)
        # waiting for their turn (fair share)
        commands += [("HGET", self.keys.fair(lane), "staged") for lane in lanes]
        for lane in lanes:
            # prefix affinity: held for a worker (waiting); the affinity stream's are in flight
            commands += [
                ("ZCARD", self.keys.affinity_held(lane)),
                ("XLEN", self.keys.affinity_stream(lane)),
            ]
        replies = await self.conn.pipelined([*commands, *extra])
        n = len(lanes)
        staged = [int(x or 0) for x in replies[2 * n : 3 * n]]
        held = [int(x or 0) for x in replies[3 * n : 5 * n : 2]]
        aff_running = [int(x or 0) for x in replies[3 * n + 1 : 5 * n : 2]]
        sizes: list[tuple[int, int, str]] = []  # total, pending, last delivered id
        for i in range(n):
            total, group = replies[2 * i], _our_group(replies[2 * i + 1])
            # no group yet: no claim has read the lane, so all of it waits
            pending, last = (
                (0, "0-0")
                if group is None
                else (
                    int(group["pending"]),
                    text(group["last-delivered-id"]),
                )
            )
            sizes.append((int(total) if not isinstance(total, Exception) else 0, pending, last))
        oldest = await self.conn.checked(
            [
                ("XRANGE", lane, f"({last}", "+", "COUNT", 1)
                for lane, (_, _, last) in zip(lanes, sizes, strict=True)
            ]
        )
        rows: list[tuple[int, int, float | None]] = []
        for i, (total, pending, _) in enumerate(sizes):
            age = (
                max(0.0, now - int(text(oldest[i][0][0]).split("-")[0]) / 1000)
                if oldest[i]
                else None
            )
            rows.append(
                (max(0, total - pending) + staged[i] + held[i], pending + aff_running[i], age)
            )
        return rows, replies[5 * n :]

    async def depth(self, model: str) -> int:
        # completion and every skip XDEL the lane entry with the terminal write: what is left in
        # a lane is waiting or in flight
        commands: list[Command] = []
        for lane in self.keys.lanes(model, self.settings.pool_count):
            commands += [
                ("XLEN", lane),
                ("HGET", self.keys.fair(lane), "staged"),
                ("ZCARD", self.keys.affinity_held(lane)),  # prefix affinity: held, and running
                ("XLEN", self.keys.affinity_stream(lane)),
            ]
        return sum(int(n or 0) for n in await self.conn.checked(commands))

    async def backlog(self, model: str) -> list[LaneBacklog]:
        # 1: each lane's length, its group (delivered and pending) and its active tenants;
        # 2: each active tenant's staged count and weight
        pools = self.settings.pool_count
        lanes = self.keys.lanes(model, pools)
        first = self._lanes_read(lanes)
        first += [("ZRANGE", self.keys.fair_active(lane), 0, -1) for lane in lanes]
        replies = await self.conn.pipelined(first)
        sizes: list[tuple[int, int]] = []
        actives: list[list[str]] = []
        for i in range(len(lanes)):
            total, group = replies[2 * i], _our_group(replies[2 * i + 1])
            active = replies[2 * len(lanes) + i]
            if isinstance(total, Exception) or isinstance(active, Exception):
                raise total if isinstance(total, Exception) else active
            pending = 0 if group is None else int(group["pending"])
            sizes.append((int(total), pending))
            actives.append([text(t) for t in active])
        second: list[Command] = []
        for lane, tenants in zip(lanes, actives, strict=True):
            for tenant in tenants:
                second += [
                    ("ZCARD", self.keys.tenant_queue_prefix(lane) + tenant),
                    ("HGET", self.keys.fair(lane), f"w:{tenant}"),
                ]
        counts: list[Any] = await self.conn.checked(second) if second else []
        out, at = [], 0
        for p, priority in enumerate(Priority):
            staged: dict[str, TenantBacklog] = {}
            queued = in_flight = 0
            for i in range(p * pools, (p + 1) * pools):  # a priority's size pools together
                queued += max(0, sizes[i][0] - sizes[i][1])
                in_flight += sizes[i][1]
                for tenant in actives[i]:
                    n, w = int(counts[at] or 0), float(counts[at + 1] or 1.0)
                    at += 2
                    was = staged.get(tenant)
                    staged[tenant] = TenantBacklog(tenant, n + (was.staged if was else 0), w)
            waiting = [t for t in staged.values() if t.staged > 0]
            out.append(LaneBacklog(priority, queued, in_flight, waiting))
        return out

    def _lanes_read(self, lanes: Sequence[str]) -> list[Command]:
        """Raw commands that read each lane's length and groups (`_our_group` reads the
        latter). Raw, sent on the broker's own connections: shedding reads the backlog every
        `queue_wait_ttl_s` under load, and through redis-py's pipeline (a parser and a timeout
        per reply) it was ~2.5 % of the gateway's CPU (docs/benchmarks.md)."""
        commands: list[Command] = []
        for lane in lanes:
            # XINFO GROUPS: an error for a lane that does not exist yet
            commands += [("XLEN", lane), ("XINFO", "GROUPS", lane)]
        return commands


def _our_group(groups: Any) -> Any:
    """The workers' group from a raw XINFO GROUPS reply (a flat field-value list per group, or
    a map under RESP3) as a dict by field name; None before a claim has created it."""
    if isinstance(groups, Exception):  # no lane yet
        return None
    for group in groups:
        if isinstance(group, list):
            group = {text(k): v for k, v in zip(group[::2], group[1::2], strict=True)}
        elif isinstance(group, dict):
            group = {text(k): v for k, v in group.items()}
        if text(group["name"]) == GROUP:
            return group
    return None
