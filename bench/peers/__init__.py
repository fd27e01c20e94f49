"""The peer queues bench/queue_overhead.py measures tokenyard against, one module each; their
libraries are the optional `bench-peers` extra, imported only when a peer runs."""

from __future__ import annotations

from bench.peers import arq, celery, dramatiq, rq, taskiq
from bench.peers.base import Peer

PEERS: dict[str, Peer] = {p.name: p for p in (arq.PEER, taskiq.PEER, rq.PEER, celery.PEER,
                                               dramatiq.PEER)}  # fmt: skip
