"""A standalone test consumer process on any backend's broker URL, driven by the fault tests.

Run as ``python -m tests.faults.consumer --url URL --prefix P --model M ...``. It prints one
line per event (``ready``, ``claimed``, ``completed``, ``retried``, ``lost``...), flushed, so a
test can wait on its progress. Every completion the broker accepted is also appended to a log
outside the broker (:func:`accepted_log`), which is how tests spot duplicates.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from tokenyard.broker import connect, wait_until_ready
from tokenyard.broker.core import Lease
from tokenyard.config import BrokerSettings
from tokenyard.errors import BrokerUnavailable
from tokenyard.messages import FinishReason, JobResult, JobStatus

# where the accepted logs go (a test's tmp dir); consumers inherit it from the test
ACCEPTED_DIR_ENV = "TOKENYARD_FAULTS_ACCEPTED_DIR"


def accepted_log(prefix: str) -> Path:
    """File of job ids, one line per completion the broker accepted, shared by the consumers
    of one prefix; a file, not the broker, so it outlives a broker crash on any backend."""
    folder = os.environ.get(ACCEPTED_DIR_ENV) or tempfile.gettempdir()
    return Path(folder) / f"tokenyard-faults-{prefix}.accepted"


def read_accepted(prefix: str) -> Counter[str]:
    """Job id -> completions the broker accepted, as the consumers logged them."""
    try:
        return Counter(accepted_log(prefix).read_text().split())
    except FileNotFoundError:
        return Counter()


def log_accepted(prefix: str, job_ids: Sequence[str]) -> None:
    """Append `job_ids` in one O_APPEND write, so consumers sharing the file never interleave."""
    fd = os.open(accepted_log(prefix), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, "".join(f"{job_id}\n" for job_id in job_ids).encode())
    finally:
        os.close(fd)


def result_text(consumer: str, prompt: str | None) -> str:
    """The text a consumer writes as a job's result, so a test can tell who finished it."""
    return f"{consumer}|{prompt}"


def emit(*parts: object) -> None:
    print(*parts, flush=True)


class Consumer:
    """Claim → (hold, renewing) → complete or retry, with a periodic reap alongside."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.name: str = args.name or f"{socket.gethostname()}:{os.getpid()}:{int(time.time())}"
        self.broker = connect(
            BrokerSettings(
                url=args.url,
                tables_url=args.tables,
                prefix=args.prefix,
                lease_s=args.lease_s,
                max_deliveries=args.max_deliveries,
                backoff_base_s=args.backoff_base_s,
                backoff_max_s=args.backoff_max_s,
            )
        )
        self.stop = asyncio.Event()
        self.in_flight = 0
        self.claimed = 0
        self.accepted = 0
        self.fenced = 0
        self.tasks: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop.set)
        await wait_until_ready(self.broker)
        emit("ready", self.name)
        next_reap = 0.0
        try:
            while not self.stop.is_set():
                try:
                    if time.monotonic() >= next_reap:
                        report = await self.broker.queue.reap(self.args.model)
                        next_reap = time.monotonic() + self.args.reap_every_s
                        if report.requeued or report.dead:
                            emit("reaped", len(report.requeued), len(report.dead))
                    free = self.args.slots - self.in_flight
                    if free <= 0:
                        await asyncio.sleep(0.02)
                        continue
                    # Block no longer than the reap period, so reaping keeps its pace.
                    block = min(0.2, self.args.reap_every_s)
                    leases = await self.broker.queue.claim(self.args.model, self.name, free, block)
                except BrokerUnavailable as exc:
                    emit("unavailable", str(exc).replace("\n", " ")[:200])
                    await asyncio.sleep(0.1)
                    continue
                if not leases:
                    continue
                self.claimed += len(leases)
                self.in_flight += len(leases)
                # the hold counts from the claim: a stop that lands before its task starts must
                # not push the hold (and its renewals) past the resume
                until = time.monotonic() + self.args.hold_s
                emit("claimed", len(leases), self.claimed)
                task = asyncio.create_task(self.process(leases, until))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
        finally:
            for task in list(self.tasks):
                task.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
            await self.broker.close()
            emit("stopped", self.claimed, self.accepted, self.fenced)

    async def process(self, leases: list[Lease], until: float) -> None:
        try:
            live = await self.hold(leases, until)
            marker = self.args.fail_marker
            failing = [x for x in live if marker and marker in (x.spec.prompt or "")]
            passing = [x for x in live if not (marker and marker in (x.spec.prompt or ""))]
            for lease in failing:
                # The attempt number in the error lets a test check the dead letter keeps the last.
                retrying = await self.broker.queue.retry(
                    lease, f"boom attempt {lease.spec.attempt}"
                )
                emit("retried" if retrying else "dead", lease.spec.id, lease.spec.attempt)
            await self.complete(passing)
        except BrokerUnavailable as exc:
            # The leases stay pending; a reaper hands them out again.
            emit("unavailable", str(exc).replace("\n", " ")[:200])
        finally:
            self.in_flight -= len(leases)

    async def hold(self, leases: list[Lease], until: float) -> list[Lease]:
        """Keep the jobs until `until` (`--hold-s` after their claim), renewing; returns the
        leases still ours."""
        live = leases
        while live:
            remaining = until - time.monotonic()
            if remaining <= 0:
                break
            every = self.args.renew_every_s
            await asyncio.sleep(min(every, remaining) if every > 0 else remaining)
            # Checked after waking: a process stopped past its hold completes without renewing,
            # which is what a zombie that lost its lease unawares does.
            if every <= 0 or time.monotonic() >= until:
                break
            kept = await self.broker.queue.renew(live)
            lost = [x for x, ok in zip(live, kept, strict=True) if not ok]
            if lost:
                emit("lost", len(lost))
            live = [x for x, ok in zip(live, kept, strict=True) if ok]
        return live

    async def complete(self, leases: Sequence[Lease]) -> None:
        if not leases:
            return
        results = [
            (
                lease,
                JobResult(
                    status=JobStatus.SUCCEEDED,
                    finish_reason=FinishReason.STOP,
                    text=result_text(self.name, lease.spec.prompt),
                    worker=self.name,
                ),
            )
            for lease in leases
        ]
        accepted = await self.broker.queue.complete_many(results)
        ok = [lease.spec.id for lease, yes in zip(leases, accepted, strict=True) if yes]
        if ok:
            log_accepted(self.args.prefix, ok)
        self.accepted += len(ok)
        self.fenced += len(leases) - len(ok)
        emit("completed", len(ok), len(leases) - len(ok), self.accepted, self.fenced)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--url", required=True)
    p.add_argument(
        "--tables",
        default=os.environ.get("TOKENYARD_BROKER_TABLES_URL", ""),
        help="amqp:// lanes: their tables' Redis URL",
    )
    p.add_argument("--prefix", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--name", default=None, help="consumer name (default host:pid:start)")
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--lease-s", type=float, default=30.0)
    p.add_argument("--hold-s", type=float, default=0.0, help="keep each batch this long")
    p.add_argument("--renew-every-s", type=float, default=0.0, help="0: never renew")
    p.add_argument("--reap-every-s", type=float, default=0.5)
    p.add_argument("--fail-marker", default=None, help="retry jobs whose prompt contains it")
    p.add_argument("--max-deliveries", type=int, default=5)
    p.add_argument("--backoff-base-s", type=float, default=0.5)
    p.add_argument("--backoff-max-s", type=float, default=60.0)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(Consumer(args).run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
