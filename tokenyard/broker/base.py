"""Transitional: the all-roles interface the Redis and memory brokers still implement whole.

Callers type against the roles in `core.py` and `tables.py` through `Backend`.
"""

from __future__ import annotations

from typing import Protocol

from tokenyard.broker.core import QueueCore
from tokenyard.broker.tables import (
    Audit,
    Directory,
    Quotas,
    ResponseStore,
    WorkerRegistry,
)


class Broker(QueueCore, ResponseStore, WorkerRegistry, Directory, Quotas, Audit, Protocol):
    """Every role at once, and its connection's lifetime."""

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        """Release connections."""
        return None
