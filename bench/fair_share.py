"""Fair share measured with real workers (sim engine) on the real broker (Valkey, fair.lua).

Two scenarios, printed as one JSON object:

* backlog: tenant `a` enqueues `--backlog` jobs, then tenant `b` `--late` jobs (weights 1:1).
  Bound: at most `late + fair_window + 2·slots` of a's jobs finish before b's last one (b
  alternates with a once its first job is staged; the window and what the workers already
  hold are ahead of it), i.e. b's wait is that many jobs' service time, not a's backlog.
* contention: tenants with `--weights` and different `--sizes` (max_tokens) all keep the lane
  full; each tenant's share of generated tokens, over the first `--tokens` generated, against
  its weight's share.

    python -m bench.fair_share                       # embedded Valkey, the full sizes
    python -m bench.fair_share --broker redis://h:6379 --backlog 2000 --tokens 40000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from collections.abc import Sequence
from typing import Any

from tokenyard.broker import Backend, connect, new_job_id
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.config import BrokerSettings, WorkerSettings
from tokenyard.engines.sim import SimEngine
from tokenyard.messages import JobRecord, JobSpec, JobStatus, SamplingParams
from tokenyard.worker.worker import Worker

MODEL = "fair-sim"
CHUNK = 500  # jobs per enqueue_many


def spec(tenant: str, weight: float, max_tokens: int) -> JobSpec:
    # a one-token prompt: a job's fair cost (prompt + max_tokens) is then ~ what it generates
    return JobSpec(
        id=new_job_id(MODEL),
        model=MODEL,
        tenant=tenant,
        prompt_token_ids=[100],
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        created_at=time.time(),
        stream=False,
        weight=weight,
    )


async def enqueue(broker: Backend, specs: Sequence[JobSpec]) -> None:
    for i in range(0, len(specs), CHUNK):
        await broker.queue.enqueue_many(specs[i : i + CHUNK])


class Fleet:
    """In-process workers with a cheap sim engine (a step ~1 ms), started and drained here."""

    def __init__(self, settings: BrokerSettings, workers: int, slots: int) -> None:
        self.settings, self.count, self.slots = settings, workers, slots
        self.running: list[tuple[Worker, asyncio.Task[None], Backend]] = []

    async def start(self) -> None:
        for i in range(self.count):
            broker = connect(self.settings)
            engine = SimEngine(
                max_seqs=self.slots,
                prefill_base=0.0005,
                prefill_per_token=0.0,
                decode_base=0.001,
                decode_per_seq=0.0,
            )
            options = WorkerSettings(
                model=MODEL, engine="sim", max_seqs=self.slots, heartbeat_s=0.5, claim_block_s=0.1
            )
            worker = Worker(broker, engine, options, consumer=f"fair-{i}")
            self.running.append((worker, asyncio.create_task(worker.run()), broker))

    async def stop(self) -> None:
        for worker, _, _ in self.running:
            worker.drain()
        await asyncio.gather(*(task for _, task, _ in self.running), return_exceptions=True)
        for _, _, broker in self.running:
            await broker.close()
        self.running.clear()


async def records(broker: Backend, specs: Sequence[JobSpec]) -> list[JobRecord]:
    out: list[JobRecord] = []
    for i in range(0, len(specs), CHUNK):
        found = await broker.queue.records([s.id for s in specs[i : i + CHUNK]])
        out += [r for r in found if r is not None]
    return out


def finished(rs: Sequence[JobRecord]) -> list[JobRecord]:
    return [r for r in rs if r.status == JobStatus.SUCCEEDED and r.finished_at is not None]


async def backlog(
    settings: BrokerSettings, n_backlog: int, n_late: int, workers: int, slots: int
) -> dict[str, Any]:
    broker = connect(settings)
    fleet = Fleet(settings, workers, slots)
    try:
        a = [spec("a", 1.0, 4) for _ in range(n_backlog)]
        late = [spec("b", 1.0, 4) for _ in range(n_late)]
        await enqueue(broker, a)
        await fleet.start()
        await asyncio.sleep(0.5)  # a's backlog is being served when b arrives
        b_at = time.time()
        await enqueue(broker, late)
        give_up = time.monotonic() + 120
        while True:
            done_b = finished(await records(broker, late))
            if len(done_b) == n_late or time.monotonic() > give_up:
                break
            await asyncio.sleep(0.05)
        await fleet.stop()
        b_last = max((r.finished_at or 0.0) for r in done_b) if done_b else float("nan")
        done_a = finished(await records(broker, a))
        a_ahead = sum(1 for r in done_a if b_at <= (r.finished_at or 0.0) <= b_last)
        # the service rate before b arrived (a alone), to state the bound in seconds
        before = sorted(r.finished_at or 0.0 for r in done_a if (r.finished_at or 0.0) < b_at)
        rate = (len(before) - 1) / (before[-1] - before[0]) if len(before) > 2 else float("nan")
        jobs_bound = n_late + settings.fair_window + 2 * workers * slots
        return {
            "backlog_a": n_backlog,
            "late_b": n_late,
            "b_done": len(done_b),
            "a_jobs_done_while_b_waited": a_ahead,
            "bound_a_jobs": jobs_bound,
            "b_wait_s": round(b_last - b_at, 3),
            "jobs_per_s_before_b": round(rate, 1),
            # the bound in time: b's jobs plus the bounded number of a's, at that service rate
            "bound_wait_s": round((n_late + jobs_bound) / rate, 3),
            # what b would wait behind a's whole backlog (FIFO)
            "fifo_wait_s": round(n_backlog / rate, 3),
        }
    finally:
        await fleet.stop()
        await broker.close()


async def contention(
    settings: BrokerSettings,
    weights: dict[str, float],
    sizes: dict[str, int],
    tokens: int,
    workers: int,
    slots: int,
) -> dict[str, Any]:
    broker = connect(settings)
    fleet = Fleet(settings, workers, slots)
    try:
        # every tenant's backlog alone outlasts the measurement: the lanes stay full throughout
        jobs = {t: [spec(t, weights[t], sizes[t]) for _ in range(tokens // sizes[t] + slots * 2)]
                for t in weights}  # fmt: skip
        # interleaved, so no tenant's jobs fill the stream's window first
        for i in range(0, max(len(js) for js in jobs.values()), CHUNK // len(jobs)):
            for js in jobs.values():
                await broker.queue.enqueue_many(js[i : i + CHUNK // len(jobs)])
        started = time.monotonic()
        await fleet.start()
        every = [s for js in jobs.values() for s in js]
        give_up = time.monotonic() + 300
        while time.monotonic() < give_up:
            done = finished(await records(broker, every))
            if sum(len(r.result.token_ids) for r in done if r.result) >= tokens:
                break
            await asyncio.sleep(0.1)
        await fleet.stop()
        took = time.monotonic() - started
        done = finished(await records(broker, every))
        # the first `tokens` generated, in finishing order: all tenants were busy throughout
        done.sort(key=lambda r: r.finished_at or 0.0)
        per: dict[str, int] = dict.fromkeys(weights, 0)
        total = 0
        for r in done:
            if total >= tokens:
                break
            n = len(r.result.token_ids) if r.result else 0
            per[r.spec.tenant] += n
            total += n
        weight_sum = sum(weights.values())
        shares = {}
        for t in weights:
            expected = weights[t] / weight_sum
            measured = per[t] / total
            shares[t] = {
                "weight": weights[t],
                "max_tokens": sizes[t],
                "tokens": per[t],
                "share": round(measured, 4),
                "expected": round(expected, 4),
                "relative_error": round(measured / expected - 1, 4),
            }
        return {"tokens": total, "seconds": round(took, 2), "tenants": shares}
    finally:
        await fleet.stop()
        await broker.close()


async def run(args: argparse.Namespace, url: str) -> dict[str, Any]:
    def fresh() -> BrokerSettings:
        prefix = f"fair{uuid.uuid4().hex[:6]}"
        return BrokerSettings(url=url, prefix=prefix, fair_window=args.fair_window)

    weights = dict(zip(args.tenants, args.weights, strict=True))
    sizes = dict(zip(args.tenants, args.sizes, strict=True))
    out: dict[str, Any] = {
        "bench": "fair_share",
        "broker": "valkey",
        "workers": args.workers,
        "slots": args.slots,
        "fair_window": args.fair_window,
    }
    if args.only in (None, "backlog"):
        out["backlog"] = await backlog(fresh(), args.backlog, args.late, args.workers, args.slots)
    if args.only in (None, "contention"):
        out["contention"] = await contention(
            fresh(), weights, sizes, args.tokens, args.workers, args.slots
        )
    return out


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--broker", help="broker URL; default: a private embedded Valkey")
    p.add_argument("--backlog", type=int, default=2000, help="tenant a's jobs, enqueued first")
    p.add_argument("--late", type=int, default=20, help="tenant b's jobs, enqueued after")
    p.add_argument("--tenants", nargs="+", default=["a", "b", "c"])
    p.add_argument("--weights", nargs="+", type=float, default=[1.0, 1.0, 3.0])
    p.add_argument("--sizes", nargs="+", type=int, default=[8, 32, 16], help="max_tokens")
    p.add_argument("--tokens", type=int, default=40_000, help="generated tokens measured")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--slots", type=int, default=8, help="sequences per worker")
    p.add_argument("--fair-window", type=int, default=4)
    p.add_argument("--only", choices=["backlog", "contention"], help="run one scenario")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    if args.broker:
        result = asyncio.run(run(args, args.broker))
    else:
        with EmbeddedServer() as server:
            result = asyncio.run(run(args, server.url))
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
