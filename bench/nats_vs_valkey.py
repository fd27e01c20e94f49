"""NATS JetStream vs Valkey, one run side by side: queue overhead and the HTTP path.

Every (broker, system) gets a fresh private server on a free TCP port (EmbeddedNats, the
embedded Valkey; both fsync about once a second). Queue systems, driven from this process as in
bench/queue_overhead.py (whose consumer processes and job specs it reuses):

  tokenyard-broker  queue.enqueue here; a consumer process running queue.claim + complete_many
                    (no worker, no engine), on each broker
  nats-py           plain nats-py on the same nats-server (bench/peers/nats_py.py): await
                    js.publish, pull fetch + msg.ack(); the loop a NATS user would write instead

  one_at_a_time  each enqueue awaited before the next, the consumer running meanwhile
  in_flight      --in-flight enqueues outstanding at once
  latency        enqueue -> done of single jobs at light load

`tokenyard-http` runs `tokenyard gateway` + a tokenyard worker (zero-cost sim engine) on each
broker and sends POST /v1/completions sync and streamed, one at a time and in flight.

Per job: server CPU, consumer CPU and messages: on NATS the server's in/out message counts
(/varz) and the producer's own client counters (messages it sent per enqueue: each JetStream
request is one round trip), the benchmark's depth polls taken out (they go through a client of
their own); on Valkey the server's socket reads (round trips) and commands. Prints one JSON.
The phases, timing and ratios are bench/broker_compare.py's.

    python -m bench.nats_vs_valkey [--broker nats|valkey|both] [--jobs 2000] [--http-requests 300]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import urllib.request
from collections.abc import Iterator, Sequence
from typing import Any

from bench import broker_compare as bc
from bench.common import proc_cpu_s
from bench.peers import nats_py
from tokenyard.broker import Backend
from tokenyard.broker.nats.embedded import EmbeddedNats

GOAL = 0.8  # tokenyard on NATS: at least this share of plain nats-py's rate on the same server


class NatsServer:
    tables_url = ""

    def __init__(self, server: EmbeddedNats) -> None:
        self.server = server
        self.url = server.url

    def varz(self) -> dict[str, Any]:
        assert self.server.monitor_url is not None
        with urllib.request.urlopen(f"{self.server.monitor_url}/varz", timeout=5) as reply:
            found: dict[str, Any] = json.load(reply)
        return found

    def snapshot(self, before: bool) -> bc.Snapshot:
        varz = self.varz()
        counters = {"in_msgs": int(varz["in_msgs"]), "out_msgs": int(varz["out_msgs"])}
        return bc.Snapshot({"server": proc_cpu_s(self.server.pid)}, counters)

    def version(self) -> str:
        return f"nats-server {self.varz()['version']}"

    def valkey_commands(self) -> int | None:
        return None  # depth polls go to NATS: their messages are the poller's own counters

    def counts(
        self, d: dict[str, int], sent: int | None, polled: tuple[int, int], n: int
    ) -> dict[str, Any]:
        """Server in/out messages per job, the poller's (sent, received) out; with the
        producer's own count, what the consumer sent (the rest)."""
        p_out, p_in = polled
        row = {
            "server_in_msgs_per_job": bc.per(d["in_msgs"] - p_out, n),
            "server_out_msgs_per_job": bc.per(d["out_msgs"] - p_in, n),
        }
        if sent is not None:
            row["producer_msgs_per_job"] = bc.per(sent, n)
            row["consumer_msgs_per_job"] = bc.per(d["in_msgs"] - p_out - sent, n)
        return row


@contextlib.contextmanager
def nats_server() -> Iterator[bc.Server]:
    with EmbeddedNats(sync="everysec") as server:
        yield NatsServer(server)


def nats_stats(backend: Backend) -> dict[str, int] | None:
    """The NATS client counters under a NATS backend's queue (None on Valkey or unopened)."""
    conn = getattr(backend.queue, "conn", None)
    client = getattr(conn, "_nc", None)
    return None if client is None else nats_py.client_stats(client)


class TokenyardProducer(bc.TokenyardProducer):
    """On NATS the producer's and the poller's messages are their clients' own counters."""

    def messages_sent(self) -> int | None:
        stats = nats_stats(self.broker)
        return None if stats is None else stats["out_msgs"]

    def poll_messages(self) -> tuple[int, int]:
        """(sent, received) by the poller on NATS; on Valkey (round trips, commands)."""
        stats = nats_stats(self.poller)
        return super().poll_messages() if stats is None else (stats["out_msgs"], stats["in_msgs"])


class NatsPyProducer(nats_py.NatsPyProducer):
    def __init__(self, srv: bc.Server) -> None:
        super().__init__(srv.url)

    def poll_messages(self) -> tuple[int, int]:
        return 0, 0  # done ids are pushed to it


def consumer_argv(srv: bc.Server) -> list[str]:
    return [sys.executable, "-m", "bench.nats_vs_valkey", "--serve-nats-py", "--url", srv.url]


BROKER = bc.Broker(
    name="nats",
    benchmark="nats_vs_valkey",
    server=nats_server,
    plain=bc.Plain("nats-py", nats_py.SETTINGS, NatsPyProducer, consumer_argv),
    fsync="Valkey appendfsync everysec; JetStream sync_interval 1s",
    distributions=("nats-py",),
    goal=GOAL,
    producer=TokenyardProducer,
)


def main(argv: Sequence[str] | None = None) -> int:
    p = bc.parser(BROKER.name, __doc__)
    p.add_argument("--serve-nats-py", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_nats_py:
        nats_py.serve(args.url, nats_py.SETTINGS)
        return 0
    return bc.main(BROKER, p, args)


if __name__ == "__main__":
    sys.exit(main())
