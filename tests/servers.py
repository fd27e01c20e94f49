"""Helpers for tests that need a real valkey/redis server, or RabbitMQ (tests/rabbitmq_server)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.rabbitmq_server import RabbitServer
from tokenyard.broker.redis.cluster import Cluster, running_cluster
from tokenyard.broker.redis.embedded import EmbeddedServer

__all__ = ["Cluster", "RabbitServer", "alive", "running_cluster", "running_server"]


@contextmanager
def running_server(**kwargs: Any) -> Iterator[EmbeddedServer]:
    """Yield a started ``EmbeddedServer(**kwargs)``; stop it (and drop its temp dir) on exit."""
    server = EmbeddedServer(**kwargs)
    try:
        server.start()
        yield server
    finally:
        server.stop()


def alive(pid: int) -> bool:
    """Whether a process runs (Linux /proc); an orphan reparented to an init that does not reap
    stays a zombie, and that is dead too."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
