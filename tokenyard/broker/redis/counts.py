"""The Redis Streams lanes' counts: what waits and what runs in each lane (its stream and
consumer group, fair-share staging, prefix-affinity holds), with the job table's tallies."""

from __future__ import annotations

from typing import Any

from tokenyard.broker.core import BrokerStats, LaneBacklog, LaneStats, TenantBacklog
from tokenyard.broker.redis.channel import Command
from tokenyard.broker.redis.connection import text
from tokenyard.broker.redis.keys import GROUP
from tokenyard.broker.redis.table import OnTable
from tokenyard.messages import Priority


class StreamCounts(OnTable):
    """`Stats` for Redis Streams lanes (depths, ages, backlog) over the job table's server."""

    async def stats(self, model: str) -> BrokerStats:
        """Two round trips: lane sizes, groups and counters; then each lane's oldest waiting."""
        now = self.clock()
        pools = self.settings.pool_count
        lanes, commands = self._lanes_read(model)
        # waiting for their turn (fair share)
        commands += [("HGET", self.keys.fair(lane), "staged") for lane in lanes]
        for lane in lanes:
            # prefix affinity: held for a worker (waiting); the affinity stream's are in flight
            commands += [
                ("ZCARD", self.keys.affinity_held(lane)),
                ("XLEN", self.keys.affinity_stream(lane)),
            ]
        commands += self.table.tally_commands(model)
        replies = await self.conn.pipelined(commands)
        tallies = replies[5 * len(lanes) :]
        staged = [int(n or 0) for n in replies[2 * len(lanes) : 3 * len(lanes)]]
        held = [int(n or 0) for n in replies[3 * len(lanes) : 5 * len(lanes) : 2]]
        aff_running = [int(n or 0) for n in replies[3 * len(lanes) + 1 : 5 * len(lanes) : 2]]
        sizes: list[tuple[int, int, str]] = []  # total, pending, last delivered id
        for i in range(len(lanes)):
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
        stats = []
        for p, priority in enumerate(Priority):
            # a priority's size pools are reported together
            mine = range(p * pools, (p + 1) * pools)
            ages = [
                max(0.0, now - int(text(oldest[i][0][0]).split("-")[0]) / 1000)
                for i in mine
                if oldest[i]
            ]
            stats.append(
                LaneStats(
                    model,
                    priority,
                    waiting=sum(
                        max(0, sizes[i][0] - sizes[i][1]) + staged[i] + held[i] for i in mine
                    ),
                    in_flight=sum(sizes[i][1] + aff_running[i] for i in mine),
                    oldest_waiting_age_s=max(ages) if ages else None,
                )
            )
        return self.table.stats_of(model, stats, tallies)

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
        lanes, first = self._lanes_read(model)
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

    def _lanes_read(self, model: str) -> tuple[list[str], list[Command]]:
        """`model`'s lanes, and raw commands that open with each lane's length and groups
        (`_our_group` reads the latter). Raw, sent on the broker's own connections: shedding
        reads the backlog every `queue_wait_ttl_s` under load, and through redis-py's pipeline
        (a parser and a timeout per reply) it was ~2.5 % of the gateway's CPU
        (docs/benchmarks.md)."""
        lanes = self.keys.lanes(model, self.settings.pool_count)
        commands: list[Command] = []
        for lane in lanes:
            # XINFO GROUPS: an error for a lane that does not exist yet
            commands += [("XLEN", lane), ("XINFO", "GROUPS", lane)]
        return lanes, commands


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
