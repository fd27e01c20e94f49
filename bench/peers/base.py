"""What every system's adapter in the queue-overhead benchmark shares: the producer's interface,
the in-flight driver, and the keys on which peer jobs mark themselves done."""

from __future__ import annotations

import abc
import asyncio
import importlib
from collections.abc import Awaitable, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

DONE_KEY = "qo:done"  # peers RPUSH each finished job's id here
QUEUE = "qo"
PREFIX = "qo"


def peer(module: str) -> Any:
    """Import a peer's module; peers are an optional extra, untyped to this benchmark."""
    return importlib.import_module(module)


async def in_flight(ids: Sequence[str], width: int, send: Callable[[str], Awaitable[Any]]) -> None:
    """`send(id)` for every id, `width` outstanding at once: each of `width` producers takes the
    next id as soon as its last call returned."""
    feed: Iterator[str] = iter(ids)

    async def producer() -> None:
        for job_id in feed:
            await send(job_id)

    await asyncio.gather(*(producer() for _ in range(min(width, len(ids)))))


class Producer(abc.ABC):
    """The benchmark's side of one system: enqueue jobs one by one and observe them done."""

    poll_commands = 1  # Valkey commands one done_count() sends

    def __init__(self, url: str) -> None:
        self.url = url
        self.done_client = aioredis.Redis.from_url(url)

    async def open(self) -> None:
        """Connect; called once before any enqueue."""
        await self.done_client.ping()

    @abc.abstractmethod
    async def enqueue(self, job_id: str) -> None:
        """Enqueue one no-op job through the system's single-job API."""

    async def enqueue_concurrently(self, ids: Sequence[str], width: int) -> None:
        await in_flight(ids, width, self.enqueue)

    async def wait_done(self, job_id: str, timeout_s: float) -> None:
        """Return once `job_id` is done; raise TimeoutError after `timeout_s`."""
        reply: Any = await self.done_client.blpop([DONE_KEY], timeout=timeout_s)
        if reply is None:
            raise TimeoutError(f"job {job_id} not done after {timeout_s} s")
        if reply[1] != job_id.encode():
            raise RuntimeError(f"waited for {job_id}, {reply[1]!r} finished")

    async def done_count(self) -> int:
        """How many jobs are done since the last reset."""
        return int(await self.done_client.llen(DONE_KEY))

    async def verify(self, ids: Sequence[str]) -> int:
        """How many of `ids` are observably done."""
        raw = await self.done_client.lrange(DONE_KEY, 0, -1)
        done = {x.decode() if isinstance(x, bytes) else x for x in raw}
        return len(done & set(ids))

    async def reset(self) -> None:
        """Forget done markers before the next phase."""
        await self.done_client.delete(DONE_KEY)

    async def close(self) -> None:
        await self.done_client.aclose()


class SyncProducer(Producer):
    """A peer whose client is synchronous: one at a time it blocks this loop, as its users'
    code would; in flight, a thread pool as wide as the in-flight limit sends."""

    @abc.abstractmethod
    def send(self, job_id: str) -> None: ...

    async def enqueue(self, job_id: str) -> None:
        self.send(job_id)

    async def enqueue_concurrently(self, ids: Sequence[str], width: int) -> None:
        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(max_workers=width) as pool:
            await in_flight(ids, width, lambda i: loop.run_in_executor(pool, self.send, i))


@dataclass(frozen=True)
class Peer:
    """One peer queue: the consumer settings it is given (reported, and overridable with
    --set), the distributions whose versions are reported, its producer, and its consumer's
    entry point (run in its own process on the database URL)."""

    name: str
    settings: dict[str, Any]
    distributions: list[str]
    producer: type[Producer]
    serve: Callable[[str], None]
