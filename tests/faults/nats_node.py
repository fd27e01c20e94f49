"""One node of a NATS JetStream cluster, for the network-namespace tests.

Run as ``python -m tests.faults.nats_node --dir D --host ADDR --name N --route URL...`` inside
a namespace: it starts `EmbeddedNats` there, prints ``ready`` once JetStream answers healthy
and keeps the server until SIGTERM. A SIGKILL takes the server with it (it is tied to us).
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence

from tokenyard.broker.nats.embedded import ClusterRoutes, EmbeddedNats


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dir", required=True, help="this node's own store")
    p.add_argument("--host", required=True, help="the namespace's address to listen on")
    p.add_argument("--name", required=True, help="server_name, unique in the cluster")
    p.add_argument("--port", type=int, default=4222)
    p.add_argument("--cluster", default="tokenyard")
    p.add_argument("--route-port", type=int, default=6222)
    p.add_argument("--route", action="append", default=[], help="another node's route URL")
    args = p.parse_args(argv)
    # blocked before the server starts, so a SIGTERM during startup waits for sigwait
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    server = EmbeddedNats(
        args.dir,
        keep_data=True,
        host=args.host,
        port=args.port,
        name=args.name,
        cluster=ClusterRoutes(args.cluster, args.route_port, args.route),
    )
    # every node waits for the others here: JetStream is healthy once the cluster has a leader
    server.start(timeout=90)
    print("ready", server.url, flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
