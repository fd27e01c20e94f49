"""arq: asyncio jobs on Redis lists, polled by its worker."""

from __future__ import annotations

import asyncio
from typing import Any

from bench.peers.base import DONE_KEY, Peer, Producer, peer

SETTINGS: dict[str, Any] = {
    "consumer": "arq.worker.Worker, one process (asyncio)",
    "max_jobs": 100,
    "poll_delay_s": 0.005,
    "keep_result_s": 0,
    "note": "arq polls its queue; poll_delay lowered from the 0.5 s default",
    "producer": "ArqRedis.enqueue_job",
    "done": "job does RPUSH",
}


class ArqProducer(Producer):
    async def open(self) -> None:
        await super().open()
        settings = peer("arq.connections").RedisSettings.from_dsn(self.url)
        self.pool = await peer("arq").create_pool(settings)

    async def enqueue(self, job_id: str) -> None:
        await self.pool.enqueue_job("qo_noop", job_id)

    async def close(self) -> None:
        await self.pool.aclose()
        await super().close()


def serve(url: str) -> None:
    arq_worker = peer("arq.worker")

    async def qo_noop(ctx: dict[str, Any], job_id: str) -> None:
        await ctx["redis"].rpush(DONE_KEY, job_id)

    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    worker = arq_worker.Worker(
        functions=[arq_worker.func(qo_noop, name="qo_noop")],
        redis_settings=peer("arq.connections").RedisSettings.from_dsn(url),
        max_jobs=SETTINGS["max_jobs"],
        poll_delay=SETTINGS["poll_delay_s"],
        keep_result=SETTINGS["keep_result_s"],
        log_results=False,
    )
    worker.run()


PEER = Peer("arq", SETTINGS, ["arq"], ArqProducer, serve)
