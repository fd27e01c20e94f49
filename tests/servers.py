"""Helpers for tests that need a real valkey/redis server."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tokenyard.broker.cluster import Cluster, running_cluster
from tokenyard.broker.embedded import EmbeddedServer

__all__ = ["Cluster", "running_cluster", "running_server"]


@contextmanager
def running_server(**kwargs: Any) -> Iterator[EmbeddedServer]:
    """Yield a started ``EmbeddedServer(**kwargs)``; stop it (and drop its temp dir) on exit."""
    server = EmbeddedServer(**kwargs)
    try:
        server.start()
        yield server
    finally:
        server.stop()
