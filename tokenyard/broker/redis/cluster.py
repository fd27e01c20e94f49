"""A local Valkey cluster from the embedded binary: primaries only, slots split evenly.

For tests and benchmarks of `redis+cluster://` (the Redis backend on redis-py's RedisCluster).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis

from tokenyard.broker.embedded import Fsync
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.children import free_port


class Cluster:
    """A Valkey cluster of primaries (no replicas) formed from embedded servers."""

    def __init__(self, nodes: list[EmbeddedServer], slots: list[tuple[int, int]]) -> None:
        self.nodes = nodes
        self.slots = slots  # (first, last) slot of each node

    @property
    def url(self) -> str:
        """What `BrokerSettings.url` takes: any node, the client discovers the rest."""
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}/0"

    def shard_of_slot(self, slot: int) -> int:
        return next(i for i, (lo, hi) in enumerate(self.slots) if lo <= slot <= hi)


def _cluster(client: redis.Redis, *args: str | int) -> Any:
    return client.execute_command("CLUSTER", *args)  # type: ignore[no-untyped-call]


@contextmanager
def running_cluster(
    shards: int = 3, timeout_s: float = 30.0, appendfsync: Fsync = "everysec"
) -> Iterator[Cluster]:
    """Start `shards` cluster-enabled servers, split the 16384 slots evenly, MEET, wait for ok.
    A node killed (`kill`) and started again comes back on its port, AOF and nodes.conf."""
    nodes: list[EmbeddedServer] = []
    bus_ports: list[int] = []
    try:
        for _ in range(shards):
            bus_ports.append(free_port())
            config = {
                "cluster-enabled": "yes",
                "cluster-config-file": "nodes.conf",
                "cluster-node-timeout": "5000",
                # the bus port defaults to port + 10000, which may be taken or past 65535
                "cluster-port": str(bus_ports[-1]),
            }
            nodes.append(EmbeddedServer(config=config, appendfsync=appendfsync).start())
        step = 16384 // shards
        slots = [
            (i * step, 16383 if i == shards - 1 else (i + 1) * step - 1) for i in range(shards)
        ]
        clients = [redis.Redis(port=node.port or 0) for node in nodes]
        for client, (lo, hi) in zip(clients, slots, strict=True):
            _cluster(client, "ADDSLOTSRANGE", lo, hi)
        for client in clients[1:]:
            _cluster(client, "MEET", "127.0.0.1", nodes[0].port or 0, bus_ports[0])
        give_up = time.monotonic() + timeout_s
        while True:
            infos = [_cluster(c, "INFO") for c in clients]
            texts = [i.decode() if isinstance(i, bytes) else str(i) for i in infos]
            if all("cluster_state:ok" in t and f"cluster_known_nodes:{shards}" in t for t in texts):
                break
            if time.monotonic() > give_up:
                raise TimeoutError(f"cluster did not form: {texts}")
            time.sleep(0.1)
        for client in clients:
            client.close()
        yield Cluster(nodes, slots)
    finally:
        for node in nodes:
            node.stop()
