"""Dramatiq: synchronous actors on its Redis broker, a threaded worker."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from typing import Any

import redis

from bench.peers.base import DONE_KEY, PREFIX, QUEUE, Peer, SyncProducer, peer

SETTINGS: dict[str, Any] = {
    "consumer": "dramatiq.Worker, one process",
    "threads": 8,
    "prefetch": 64,
    "worker_timeout_ms": 10,
    "note": "idle polls back off up to worker_timeout (default 1000 ms); prefetch default 2x",
    "result_backend": None,
    "producer": "actor.send (synchronous client: a thread pool when in flight)",
    "done": "job does RPUSH",
}


def dramatiq_actor(url: str, fn: Callable[[str], None]) -> tuple[Any, Any]:
    """A Redis broker and the no-op actor declared on it."""
    dramatiq = peer("dramatiq")
    broker = peer("dramatiq.brokers.redis").RedisBroker(url=url, namespace=PREFIX)
    dramatiq.set_broker(broker)
    actor = dramatiq.actor(fn, actor_name="qo_noop", queue_name=QUEUE, max_retries=0, broker=broker)
    return broker, actor


class DramatiqProducer(SyncProducer):
    async def open(self) -> None:
        await super().open()
        self.broker, self.actor = dramatiq_actor(self.url, _stub)

    def send(self, job_id: str) -> None:
        self.actor.send(job_id)

    async def close(self) -> None:
        self.broker.close()
        await super().close()


def _stub(job_id: str) -> None:
    """The producer's handle on the worker's actor; never runs here."""


def _stop_on_sigterm() -> threading.Event:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def serve(url: str) -> None:
    # read once when dramatiq.worker is imported; its default is 2 x threads
    os.environ["dramatiq_queue_prefetch"] = str(SETTINGS["prefetch"])  # noqa: SIM112
    dramatiq = peer("dramatiq")
    client = redis.Redis.from_url(url)

    def qo_noop(job_id: str) -> None:
        client.rpush(DONE_KEY, job_id)

    broker, _ = dramatiq_actor(url, qo_noop)
    stop = _stop_on_sigterm()
    worker = dramatiq.Worker(
        broker, worker_threads=SETTINGS["threads"], worker_timeout=SETTINGS["worker_timeout_ms"]
    )
    worker.start()
    stop.wait()
    worker.stop()


PEER = Peer("dramatiq", SETTINGS, ["dramatiq"], DramatiqProducer, serve)
