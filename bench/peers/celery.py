"""Celery: synchronous tasks on its Redis transport, no result backend."""

from __future__ import annotations

from typing import Any

import redis

from bench.peers.base import DONE_KEY, QUEUE, Peer, SyncProducer, peer

SETTINGS: dict[str, Any] = {
    "consumer": "celery worker, one process",
    "pool": "solo",
    "concurrency": 1,
    "prefetch_multiplier": 64,
    "flags": ["--without-gossip", "--without-mingle", "--without-heartbeat"],
    "result_backend": None,
    "producer": "app.send_task (synchronous client: a thread pool when in flight)",
    "done": "job does RPUSH",
}


def celery_app(url: str) -> Any:
    """The Celery app both sides use: Redis broker, no result backend."""
    app = peer("celery").Celery("qo", broker=url)
    app.conf.update(
        task_ignore_result=True,
        task_default_queue=QUEUE,
        worker_prefetch_multiplier=SETTINGS["prefetch_multiplier"],
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
    )
    return app


class CeleryProducer(SyncProducer):
    async def open(self) -> None:
        await super().open()
        self.app = celery_app(self.url)

    def send(self, job_id: str) -> None:
        self.app.send_task("qo_noop", args=[job_id], ignore_result=True)

    async def close(self) -> None:
        self.app.close()
        await super().close()


def serve(url: str) -> None:
    app = celery_app(url)
    client = redis.Redis.from_url(url)

    def qo_noop(job_id: str) -> None:
        client.rpush(DONE_KEY, job_id)

    app.task(name="qo_noop")(qo_noop)

    app.worker_main(
        [
            "worker",
            f"--pool={SETTINGS['pool']}",
            f"--concurrency={SETTINGS['concurrency']}",
            "--loglevel=WARNING",
            *SETTINGS["flags"],
        ]
    )


PEER = Peer("celery", SETTINGS, ["celery", "kombu"], CeleryProducer, serve)
