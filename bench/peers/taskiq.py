"""taskiq: asyncio tasks on a Redis stream (taskiq-redis's RedisStreamBroker)."""

from __future__ import annotations

import asyncio
from typing import Any

import redis.asyncio as aioredis

from bench.peers.base import DONE_KEY, QUEUE, Peer, Producer, peer

SETTINGS: dict[str, Any] = {
    "consumer": "taskiq receiver on taskiq_redis.RedisStreamBroker, one process (asyncio)",
    "max_async_tasks": 100,
    "xread_count": 100,
    "result_backend": None,
    "producer": "task.kiq",
    "done": "job does RPUSH",
}


class TaskiqProducer(Producer):
    async def open(self) -> None:
        await super().open()
        self.broker = peer("taskiq_redis").RedisStreamBroker(self.url, queue_name=QUEUE)
        self.task = self.broker.register_task(_stub, task_name="qo_noop")
        await self.broker.startup()

    async def enqueue(self, job_id: str) -> None:
        await self.task.kiq(job_id)

    async def close(self) -> None:
        await self.broker.shutdown()
        await super().close()


async def _stub(job_id: str) -> None:
    """The producer's handle on the worker's task; never runs here."""


def serve(url: str) -> None:
    broker = peer("taskiq_redis").RedisStreamBroker(
        url, queue_name=QUEUE, xread_count=SETTINGS["xread_count"]
    )
    client = aioredis.Redis.from_url(url)

    async def qo_noop(job_id: str) -> None:
        await client.rpush(DONE_KEY, job_id)

    broker.register_task(qo_noop, task_name="qo_noop")

    async def main() -> None:
        await broker.startup()
        await peer("taskiq.api").run_receiver_task(
            broker, max_async_tasks=SETTINGS["max_async_tasks"]
        )

    asyncio.run(main())


PEER = Peer("taskiq", SETTINGS, ["taskiq", "taskiq-redis"], TaskiqProducer, serve)
