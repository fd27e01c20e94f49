"""What a stored message costs nats-server, written one publish each or as JetStream atomic
batches (`allow_atomic`, nats-server 2.12+): the server's CPU per message and the answers it
sends, on a fresh private server (EmbeddedNats, file store, fsync about once a second).

Each message is written as the NATS queue writes a claim's records and a completion's Finished
events: a subject of its own, `Nats-Expected-Last-Subject-Sequence: 0` (compare-and-set
expecting none), and in the `+msg-id` rows a `Nats-Msg-Id` too. `single`: one publish each,
`--width` answers awaited together (the queue's `publish_all`); `atomic`: batches of `--width`,
the first and the committing message answered, the rest not. Prints one JSON.

    python -m bench.nats_batch_publish [--messages 20000] [--width 64] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import nats
from nats.aio.msg import Msg

from bench.common import proc_cpu_s
from tokenyard.broker.nats.embedded import EmbeddedNats

EXPECT = "Nats-Expected-Last-Subject-Sequence"
PAYLOAD = b"x" * 300  # about a Finished event; a record is ~900 bytes


async def measure(url: str, pid: int | None, n: int, width: int, rounds: int) -> dict[str, Any]:
    nc = await nats.connect(url)
    for name, allow in (("BPS", False), ("BPA", True)):
        config = {
            "name": name,
            "subjects": [f"{name.lower()}.>"],
            "storage": "file",
            "retention": "limits",
            "allow_direct": True,
            "allow_atomic": allow,
        }
        reply = await nc.request(f"$JS.API.STREAM.CREATE.{name}", json.dumps(config).encode())
        if b'"error"' in reply.data:
            raise RuntimeError(reply.data.decode())
    inbox = nc.new_inbox()
    loop = asyncio.get_running_loop()
    waiting: dict[str, asyncio.Future[bytes]] = {}
    answers = 0

    async def answered(msg: Msg) -> None:
        nonlocal answers
        answers += 1
        future = waiting.pop(msg.subject, None)
        if future is not None and not future.done():
            future.set_result(msg.data)

    await nc.subscribe(f"{inbox}.*", cb=answered)

    def expect(reply: str) -> asyncio.Future[bytes]:
        future: asyncio.Future[bytes] = loop.create_future()
        waiting[reply] = future
        return future

    async def single(tag: str, msg_id: bool) -> int:
        for start in range(0, n, width):
            pending = []
            for i in range(start, start + width):
                headers = {EXPECT: "0"} | ({"Nats-Msg-Id": f"{tag}{i}"} if msg_id else {})
                pending.append(expect(f"{inbox}.{tag}{i}"))
                await nc.publish(f"bps.{tag}.{i}", PAYLOAD, f"{inbox}.{tag}{i}", headers)
            await asyncio.gather(*pending)
        return 0

    async def atomic(tag: str, msg_id: bool) -> int:
        refused = 0
        for start in range(0, n, width):
            pending = []
            for k, i in enumerate(range(start, start + width)):
                headers = {EXPECT: "0", "Nats-Batch-Id": f"{tag}{start}"}
                headers["Nats-Batch-Sequence"] = str(k + 1)
                if msg_id:
                    headers["Nats-Msg-Id"] = f"{tag}{i}"
                reply = ""
                if k in (0, width - 1):  # the batch's start is a request, its commit too
                    reply = f"{inbox}.{tag}{i}"
                    pending.append(expect(reply))
                if k == width - 1:
                    headers["Nats-Batch-Commit"] = "1"
                await nc.publish(f"bpa.{tag}.{i}", PAYLOAD, reply, headers)
            refused += sum(b'"error"' in data for data in await asyncio.gather(*pending))
        return refused

    rows: dict[str, list[dict[str, float]]] = {}
    for r in range(rounds):
        for label, run, msg_id in (
            ("single", single, False),
            ("single+msg-id", single, True),
            ("atomic", atomic, False),
            ("atomic+msg-id", atomic, True),
        ):
            cpu0, t0, answers0 = proc_cpu_s(pid), time.monotonic(), answers
            refused = await run(f"{label.replace('+', '')}{r}x", msg_id)
            wall = time.monotonic() - t0
            rows.setdefault(label, []).append(
                {
                    "msgs_per_s": round(n / wall),
                    "server_cpu_us_per_msg": round((proc_cpu_s(pid) - cpu0) * 1e6 / n, 1),
                    "answers_per_msg": round((answers - answers0) / n, 3),
                    "refused_batches": refused,
                }
            )
    await nc.close()
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--messages", type=int, default=20000)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    load0 = os.getloadavg()
    with EmbeddedNats(sync="everysec") as server:
        rows = asyncio.run(measure(server.url, server.pid, args.messages, args.width, args.rounds))
    report = {
        "benchmark": "nats_batch_publish",
        "config": {"messages": args.messages, "width": args.width, "payload_bytes": len(PAYLOAD)},
        "loadavg_before": [round(x, 2) for x in load0],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "rows": rows,
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
