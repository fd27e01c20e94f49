"""Brokers: durable lanes of jobs, leases, results and per-job event streams."""

from __future__ import annotations

from tokenyard.broker.base import Broker
from tokenyard.broker.keys import is_job_id, new_job_id
from tokenyard.config import BrokerSettings

__all__ = ["Broker", "connect", "is_job_id", "new_job_id"]


def connect(settings: BrokerSettings) -> Broker:
    """Open the broker named by `settings.url`: memory://, redis:// / rediss:// / unix://, or
    redis+cluster://host:port (any node of a Redis Cluster)."""
    if settings.url.startswith("memory://"):
        from tokenyard.broker.memory import MemoryBroker

        return MemoryBroker(settings)
    from tokenyard.broker.redis import RedisBroker

    return RedisBroker(settings)
