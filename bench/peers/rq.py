"""RQ: synchronous jobs on Redis lists; its worker imports the job function by path."""

from __future__ import annotations

from typing import Any

import redis

from bench.peers.base import DONE_KEY, QUEUE, Peer, SyncProducer, peer

SETTINGS: dict[str, Any] = {
    "consumer": "rq.SimpleWorker (no fork per job), one process",
    "result_ttl": 0,
    "producer": "Queue.enqueue (synchronous client: a thread pool when in flight)",
    "done": "job does RPUSH",
}


class RqProducer(SyncProducer):
    async def open(self) -> None:
        await super().open()
        self.client = redis.Redis.from_url(self.url)
        self.queue = peer("rq").Queue(QUEUE, connection=self.client)

    def send(self, job_id: str) -> None:
        self.queue.enqueue(f"{__name__}.noop", job_id, result_ttl=SETTINGS["result_ttl"])

    async def close(self) -> None:
        self.client.close()
        await super().close()


def noop(job_id: str) -> None:
    """RQ's job, imported by its path (bench.peers.rq.noop) in the worker process."""
    job = peer("rq").get_current_job()
    assert job is not None
    job.connection.rpush(DONE_KEY, job_id)


def serve(url: str) -> None:
    rq = peer("rq")
    client = redis.Redis.from_url(url)
    worker = rq.SimpleWorker([rq.Queue(QUEUE, connection=client)], connection=client)
    worker.work(logging_level="WARNING")


PEER = Peer("rq", SETTINGS, ["rq"], RqProducer, serve)
