"""Every RabbitMQ queue name of the backend, in one place."""

from __future__ import annotations

import hashlib

from tokenyard.messages import Priority

# AMQP names are at most 255 bytes: a model name longer than this goes by its digest, leaving
# room for the prefix and the rest of the name
_MAX_MODEL = 100


def _safe(model: str) -> str:
    if len(model.encode()) <= _MAX_MODEL:
        return model
    return "h" + hashlib.sha256(model.encode()).hexdigest()[:32]


class Names:
    """Queue names under one prefix (the same prefix names the tables' Redis keys)."""

    def __init__(self, prefix: str = "ty") -> None:
        self.prefix = prefix

    def lane(self, model: str, priority: Priority, pool: int = 0) -> str:
        tail = f".p{pool}" if pool else ""
        return f"{self.prefix}.lane.{_safe(model)}.{priority.name.lower()}{tail}"

    @staticmethod
    def delay(lane: str, delay_ms: int) -> str:
        """A lane's retries waiting `delay_ms` (message TTL) before they return to it."""
        return f"{lane}.delay.{delay_ms}ms"

    @staticmethod
    def held(lane: str, worker: str) -> str:
        """A lane's jobs held for one worker (prefix affinity: affinity.py); each message
        returns to the lane (dead-lettered, expired) once it waited the affinity bound."""
        return f"{lane}.held.{_safe(worker)}"

    @staticmethod
    def held_of(lane: str, queue: str) -> bool:
        """Whether `queue` is one of `lane`'s held queues."""
        return queue.startswith(f"{lane}.held.")

    def dead(self, model: str) -> str:
        """Where RabbitMQ dead-letters a model's messages past the delivery limit."""
        return f"{self.prefix}.dead.{_safe(model)}"
