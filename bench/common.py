"""What the benchmark scripts share beyond tokenyard.fleet.launch (ports, readiness, child
processes): CPU time, percentiles, load and server facts, and the gateways' settings."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis

from tokenyard.bench.stats import percentile as _percentile

# Benchmarks measure the serving path: their gateways (in this process, or subprocesses that
# inherit this environment) answer nothing from the response cache and collapse nothing,
# however often a workload repeats a greedy request. bench/cache_pools.py turns them on.
os.environ.setdefault("TOKENYARD_GATEWAY_CACHE", "false")
os.environ.setdefault("TOKENYARD_GATEWAY_COLLAPSE", "false")


def proc_cpu_s(pid: int | None) -> float:
    """utime + stime of a process from /proc (0.0 where unavailable)."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100), as numpy's default; None for no values."""
    return _percentile(values, q) if values else None


def loadavg() -> list[float]:
    """1, 5 and 15 minute load averages: how busy the machine was around a measurement."""
    return [round(x, 2) for x in os.getloadavg()]


def server_version(client: redis.Redis) -> str:
    """`valkey 8.1.1` or `redis 7.2.4`."""
    info: dict[str, Any] = client.info("server")
    if "valkey_version" in info:
        return f"valkey {info['valkey_version']}"
    return f"redis {info['redis_version']}"


def command_calls(client: redis.Redis) -> dict[str, int]:
    """INFO commandstats as {command: calls}; commands run inside scripts count too."""
    stats: dict[str, dict[str, Any]] = client.info("commandstats")
    return {key.removeprefix("cmdstat_"): int(row["calls"]) for key, row in stats.items()}
