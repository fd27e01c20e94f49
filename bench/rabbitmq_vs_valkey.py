"""RabbitMQ lanes vs Valkey lanes, one run side by side: queue overhead and the HTTP path.

Every (broker, system) gets fresh private servers on free TCP ports: the embedded Valkey (AOF
everysec), or a RabbitMQ node (Debian's rabbitmq-server, tests/rabbitmq_server.py; quorum
queues, fsync on every Raft batch) with a Valkey of its own for the tables (--tables). Queue
systems, driven from this process as in bench/queue_overhead.py (whose consumers it reuses):

  tokenyard-broker  queue.enqueue here; a consumer process running queue.claim + complete_many
                    (no worker, no engine), on each broker
  aio-pika          plain aio-pika on the same node (bench/peers/aio_pika_peer.py): a confirmed
                    persistent publish to a quorum queue, a consumer with prefetch and manual
                    acks; the loop a RabbitMQ user would write instead

  one_at_a_time  each enqueue awaited before the next, the consumer running meanwhile
  in_flight      --in-flight enqueues outstanding at once
  latency        enqueue -> done of single jobs at light load

`tokenyard-http` runs `tokenyard gateway` + a tokenyard worker (zero-cost sim engine) on each
broker and sends POST /v1/completions sync and streamed, one at a time and in flight.

Per job: CPU of the consumer, of the server (RabbitMQ: the Erlang VM) and, on RabbitMQ lanes, of
the tables' Valkey; on RabbitMQ the socket reads and writes of its AMQP connections (rabbitmqctl
list_connections recv_cnt/send_cnt, read outside the measured window), on every Valkey its
socket reads (round trips) and commands, the benchmark's depth polls taken out. The phases,
timing and ratios are bench/broker_compare.py's. Prints one JSON.

    python -m bench.rabbitmq_vs_valkey [--broker rabbitmq|valkey|both] [--jobs 2000]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from bench import broker_compare as bc
from bench.common import proc_cpu_s
from bench.peers import aio_pika_peer
from tests.rabbitmq_server import RabbitServer


class RabbitLanes:
    """A RabbitMQ node for the lanes and a Valkey beside it for the tables."""

    def __init__(self, rabbit: RabbitServer, tables: bc.ValkeyServer) -> None:
        self.rabbit = rabbit
        self.tables = tables
        self.url = rabbit.url
        self.tables_url = tables.url

    def amqp_counters(self) -> dict[str, int]:
        """Socket reads and writes summed over the node's AMQP connections (open ones)."""
        out = self.rabbit.ctl(
            "list_connections", "recv_cnt", "send_cnt", "--no-table-headers", "--quiet"
        )
        reads = writes = 0
        for line in out.splitlines():
            fields = line.split()
            if len(fields) == 2 and all(f.isdigit() for f in fields):
                reads += int(fields[0])
                writes += int(fields[1])
        return {"amqp_reads": reads, "amqp_writes": writes}

    def cpu_s(self) -> dict[str, float]:
        return {"server": proc_cpu_s(self.rabbit.pid), "tables": self.tables.cpu_s()}

    def snapshot(self, before: bool) -> bc.Snapshot:
        # rabbitmqctl costs the node a second of CPU or so: outside the window both sides
        if before:
            counters = self.amqp_counters() | self.tables.counters()
            return bc.Snapshot(self.cpu_s(), counters)
        cpu = self.cpu_s()
        return bc.Snapshot(cpu, self.tables.counters() | self.amqp_counters())

    def valkey_commands(self) -> int | None:
        return self.tables.valkey_commands()  # depth polls read the tables

    def version(self) -> str:
        found = self.rabbit.ctl("eval", "rabbit_misc:version().").strip().strip('"')
        return f"rabbitmq {found}; tables {self.tables.version()}"

    def counts(
        self, d: dict[str, int], sent: int | None, polled: tuple[int, int], n: int
    ) -> dict[str, Any]:
        return {
            "server_socket_reads_per_job": bc.per(d["amqp_reads"], n),
            "server_socket_writes_per_job": bc.per(d["amqp_writes"], n),
            **bc.valkey_counts("tables", d, polled, n),
        }


@contextlib.contextmanager
def rabbit_lanes() -> Iterator[bc.Server]:
    with RabbitServer() as rabbit, bc.valkey_server() as tables:
        yield RabbitLanes(rabbit, tables)


class AioPikaProducer(aio_pika_peer.AioPikaProducer):
    def __init__(self, srv: bc.Server) -> None:
        super().__init__(srv.url)


def consumer_argv(srv: bc.Server) -> list[str]:
    return [sys.executable, "-m", "bench.rabbitmq_vs_valkey", "--serve-aio-pika", "--url", srv.url]


BROKER = bc.Broker(
    name="rabbitmq",
    benchmark="rabbitmq_vs_valkey",
    server=rabbit_lanes,
    plain=bc.Plain("aio-pika", aio_pika_peer.SETTINGS, AioPikaProducer, consumer_argv),
    fsync="Valkey appendfsync everysec (lanes; the tables beside RabbitMQ too); RabbitMQ "
    "quorum queues (fsync per Raft batch)",
    distributions=("aio-pika", "aiormq"),
)


def main(argv: Sequence[str] | None = None) -> int:
    p = bc.parser(BROKER.name, __doc__)
    p.add_argument("--serve-aio-pika", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_aio_pika:
        aio_pika_peer.serve(args.url, aio_pika_peer.SETTINGS)
        return 0
    return bc.main(BROKER, p, args)


if __name__ == "__main__":
    sys.exit(main())
