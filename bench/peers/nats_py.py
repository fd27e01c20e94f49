"""Plain nats-py on JetStream: the loop a user would write instead of tokenyard on NATS.

One work-queue stream (file storage, the server's own sync interval), one durable pull
consumer. The producer awaits each `js.publish` (its PubAck); the consumer fetches up to
--slots messages, acks each (`msg.ack()`: a plain publish, not confirmed) and says it is done
with one core-NATS publish of the job id, as the Valkey peers RPUSH theirs. Not in PEERS: those
run on Valkey; bench/nats_vs_valkey.py runs this one beside tokenyard on the same nats-server.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Sequence
from typing import Any

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import RetentionPolicy, StorageType, StreamConfig

STREAM = "QO"
SUBJECT = "qo.jobs"
DONE_SUBJECT = "qo.done"
DURABLE = "qo"

SETTINGS: dict[str, Any] = {
    "consumer": "nats-py pull_subscribe + fetch(slots) + msg.ack(), one process",
    "slots": 256,
    "fetch_timeout_s": 0.5,
    "producer": "await js.publish (PubAck), a stream with work-queue retention, file storage",
    "done": "core publish of the job id on qo.done after the ack",
}


def client_stats(client: Client) -> dict[str, int]:
    """The client's message counters (nats-py keeps them on the client)."""
    return {k: int(v) for k, v in client.stats.items()}


async def ensure_stream(client: Client) -> None:
    js = client.jetstream()
    config = StreamConfig(
        name=STREAM,
        subjects=[SUBJECT],
        retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.FILE,
    )
    await js.add_stream(config)


class NatsPyProducer:
    """js.publish per job; done ids arrive on a core subscription."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.done: set[str] = set()
        self.waiters: dict[str, asyncio.Future[None]] = {}
        self._client: Client | None = None

    @property
    def client(self) -> Client:
        assert self._client is not None, "open() first"
        return self._client

    async def open(self) -> None:
        self._client = await nats.connect(self.url)
        await ensure_stream(self.client)
        self.js = self.client.jetstream()
        await self.client.subscribe(DONE_SUBJECT, cb=self._on_done)
        await self.client.flush()

    async def _on_done(self, msg: Msg) -> None:
        job_id = msg.data.decode()
        self.done.add(job_id)
        waiter = self.waiters.pop(job_id, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def enqueue(self, job_id: str) -> None:
        await self.js.publish(SUBJECT, job_id.encode())

    async def wait_done(self, job_id: str, timeout_s: float) -> None:
        if job_id in self.done:
            return
        waiter = self.waiters[job_id] = asyncio.get_running_loop().create_future()
        await asyncio.wait_for(waiter, timeout_s)

    async def done_count(self) -> int:
        return len(self.done)

    async def verify(self, ids: Sequence[str]) -> int:
        return len(self.done & set(ids))

    async def reset(self) -> None:
        self.done.clear()

    def messages_sent(self) -> int:
        return client_stats(self.client)["out_msgs"]

    async def close(self) -> None:
        if self._client is not None:
            await self._client.drain()


def serve(url: str, settings: dict[str, Any]) -> None:
    """The consumer process: fetch, ack, say done; SIGTERM stops it."""

    async def main() -> None:
        client = await nats.connect(url)
        await ensure_stream(client)
        js = client.jetstream()
        sub = await js.pull_subscribe(SUBJECT, durable=DURABLE, stream=STREAM)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        while not stop.is_set():
            try:
                msgs = await sub.fetch(settings["slots"], timeout=settings["fetch_timeout_s"])
            except nats.errors.TimeoutError:
                continue
            for msg in msgs:
                await msg.ack()
                await client.publish(DONE_SUBJECT, msg.data)
        await client.close()  # not drain(): it waits out the pending fetch

    asyncio.run(main())
