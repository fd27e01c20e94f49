"""High-priority latency under a saturating batch-lane load: does preemption keep it low?

Starts a private Valkey and one in-process worker on the sim engine (every slot open to the
batch lane), and measures the time to first token (enqueue to the first token event) of
sequential high-priority jobs three times: on the idle worker; while --batch jobs saturate
it, with preemption (the default); and the same load without it (`preempt_lanes` empty:
a high job waits for a batch job to end). Jobs are enqueued as their real producers do: a
high job as the gateway does (token ids, streamed), a batch job as the Batches API's runner
does (not streamed: no token events, unless --stream-batch). `--rounds` repeats the three
runs in turn (a fresh worker each), so a shared machine's load drifts over all three alike,
and pools each one's samples: the p99 of 40 samples is the largest but one, one stall decides
it. Reports TTFT p50/p99 of each (pooled, and each round's loaded/idle p99 ratio), the pooled
loaded/idle p99 ratio (goal <= 1.5), and the total tokens/s of the loaded runs, with/without
(goal >= 0.9), and beside the ratio the idle p99 plus one full batch step over the idle p99
(what the step in flight alone explains). `--stages` adds where each high job's time went, from
timestamps taken on its path, and what the engine ran when it was added (see `Stages`). Prints
one JSON document.

    python -m bench.preemption [--batch 64] [--batch-tokens 200] [--high 40] [--max-seqs 16]
        [--rounds 5] [--alone-every 8] [--stages] [--stream-batch] [--quick]
        [--gap-jitter-s S] [--batch-prompt-tokens N] [--prefill-cap N] [--split K] [--cut-in]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import json
import random
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from bench.common import loadavg, percentile
from tokenyard.broker import Backend, connect, new_job_id
from tokenyard.broker.core import Lease
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.config import BrokerSettings, WorkerSettings
from tokenyard.engines.base import EngineRequest, StepOutput
from tokenyard.engines.sim import SimEngine, SimTokenizer
from tokenyard.messages import Finished, JobSpec, Priority, SamplingParams, TokenChunk
from tokenyard.worker.worker import Worker

MODEL = "sim-preempt-bench"
# a high job's path, in order: each stage is the time from the previous mark to its own
STAGES = (
    ("enqueued", "enqueue: the producer's call"),
    ("claimed", "to the worker's claim returning it (its wake-up)"),
    ("added", "claim to engine.add (preparing it, preempting a victim)"),
    ("step", "add to the start of its first engine step, its prefill (the step in flight ends)"),
    ("engine_out", "that step: its prefill and one decode (of it alone, or of the batch)"),
    ("loop_got", "engine delivery to the worker's output loop"),
    ("appended", "output loop to its token event written (the publish round trip)"),
    ("seen", "written to the reader's XREAD answering"),
)


class Stages:
    """Timestamps on one high job's path (--stages): the bench's own marks (enqueue, first
    token read) and the worker's and engine's, taken by wrapping their methods on this
    instance only (claim, engine add and delivery, the sim's sleeps, which are its steps,
    the output loop's read, the event append, the preemption round trip). Marks only the
    jobs it is told of, first time each; the wrappers cost a dict look-up per call."""

    def __init__(self) -> None:
        self.marks: dict[str, dict[str, float]] = defaultdict(dict)
        self.sleeps: list[float] = []  # start of each of the engine's sleeps
        # each sleep's (start, asked, end): the engine's step is its sleeps plus what runs
        # between them (stepping, waits for the GIL), which a high job's wait includes too
        self.slept: list[tuple[float, float, float]] = []
        # what each sleep stood for: "prefill", "decode N" (a batch of N): the step in flight
        # when a high job was added, which it waits out (`in_flight` in the summary)
        self.slept_kind: list[str] = []
        self._prefill_next = False
        self.preempt_s: list[float] = []  # queue.preempt round trips
        self.gc_s: list[float] = []  # the collector's pauses (every thread waits on them)
        self.lag_s: list[float] = []  # how late a 1 ms timer of this loop fired, each time
        self.alone: set[str] = set()  # high jobs whose first step the scheduler ran alone
        self._gc_at = 0.0

    def _collected(self, phase: str, _info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_at = time.perf_counter()
        else:
            self.gc_s.append(time.perf_counter() - self._gc_at)

    async def watch(self, stop: asyncio.Event) -> None:
        """The loop's lag and the collector's pauses while the worker runs: a stall that shows
        in every stage at once is the process not running (CPU starved, or a collection)."""
        gc.callbacks.append(self._collected)
        try:
            while not stop.is_set():
                before = time.perf_counter()
                await asyncio.sleep(0.001)
                self.lag_s.append(time.perf_counter() - before - 0.001)
        finally:
            gc.callbacks.remove(self._collected)

    def mark(self, job_id: str, name: str, at: float | None = None) -> None:
        marks = self.marks.get(job_id)
        if marks is not None and name not in marks:
            marks[name] = time.perf_counter() if at is None else at

    def attach(self, worker: Worker, engine: SimEngine) -> None:
        queue: Any = worker.queue
        claim, append, preempt = queue.claim, queue.append_events, queue.preempt

        async def claimed(*args: Any, **kwargs: Any) -> list[Lease]:
            leases: list[Lease] = await claim(*args, **kwargs)
            for lease in leases:
                self.mark(lease.spec.id, "claimed")
            return leases

        async def appended(events: Sequence[tuple[Lease, Any]]) -> list[bool]:
            written: list[bool] = await append(events)
            for lease, _ in events:
                self.mark(lease.spec.id, "appended")
            return written

        async def preempted(leases: Sequence[Lease]) -> list[bool]:
            started = time.perf_counter()
            taken: list[bool] = await preempt(leases)
            self.preempt_s.append(time.perf_counter() - started)
            return taken

        queue.claim, queue.append_events, queue.preempt = claimed, appended, preempted
        add, deliver, outputs, sleep = engine.add, engine._deliver, engine.outputs, engine._sleep
        chunks = engine._chunks

        def added(request: EngineRequest) -> None:
            self.mark(request.seq_id, "added")
            if request.alone and request.seq_id in self.marks:
                self.alone.add(request.seq_id)
            add(request)

        def delivered(outs: list[StepOutput]) -> None:
            for out in outs:
                if out.token_ids:
                    self.mark(out.seq_id, "engine_out")
            deliver(outs)

        async def got() -> list[StepOutput]:
            outs = await outputs()
            for out in outs:
                if out.token_ids:
                    self.mark(out.seq_id, "loop_got")
            return outs

        def chunked(*args: Any) -> list[int]:
            out: list[int] = chunks(*args)
            self._prefill_next = bool(out)  # the loop's next sleep is their prefill
            return out

        def slept(seconds: float) -> None:
            started = time.perf_counter()
            self.sleeps.append(started)
            if self._prefill_next:
                self._prefill_next = False
                kind = "prefill"
            else:
                kind = f"decode {round((seconds - engine.decode_base) / engine.decode_per_seq)}"
            self.slept_kind.append(kind)  # with `sleeps`, at its start: the index of both
            sleep(seconds)
            self.slept.append((started, seconds, time.perf_counter()))

        setattr(engine, "add", added)  # noqa: B010 (instance attributes over methods)
        setattr(engine, "_deliver", delivered)  # noqa: B010
        setattr(engine, "outputs", got)  # noqa: B010
        setattr(engine, "_chunks", chunked)  # noqa: B010
        if isinstance(engine, WhatIfSim):  # its own loop: it says when a prefill's sleep comes
            engine.on_prefill = lambda: setattr(self, "_prefill_next", True)
        engine._sleep = slept

    def summary(self, job_ids: Sequence[str]) -> dict[str, Any]:
        """Per stage p50/p99/max in ms over the jobs with every mark."""
        rows, kinds = [], []
        waits: dict[str, list[float]] = defaultdict(list)  # the wait ("step"), by what ran
        for job_id in job_ids:
            marks = dict(self.marks.get(job_id, {}))
            added = marks.get("added")
            kind = "none"  # no sleep under way: an idle engine, or one between its sleeps
            if added is not None:
                # its first step begins with its own prefill: the first prefill sleep begun
                # after its add (added during a step's prefill, it waits out that step's decode
                # too: one pass in an engine that runs prefill chunks and decodes together)
                marks["step"] = next(
                    (
                        t
                        for t, k in zip(self.sleeps, self.slept_kind, strict=False)
                        if t >= added and k == "prefill"
                    ),
                    float("nan"),
                )
                kind = next(
                    (
                        k
                        for (at, _, end), k in zip(self.slept, self.slept_kind, strict=False)
                        if at <= added < end
                    ),
                    kind,
                )
            names = ["sent", *(name for name, _ in STAGES)]
            if all(name in marks for name in names):
                rows.append([marks[b] - marks[a] for a, b in itertools.pairwise(names)])
                kinds.append(kind)
                waits[kind].append((marks["step"] - marks["added"]) * 1e3)
        out: dict[str, Any] = {"jobs": len(rows), "first_step_alone": len(self.alone)}
        for i, (name, what) in enumerate(STAGES):
            values = [row[i] * 1e3 for row in rows if row[i] == row[i]]
            out[name] = _ms(values) | {"what": what}
        out["in_flight"] = {
            kind: {"jobs": len(ms)} | _ms(ms) for kind, ms in sorted(waits.items())
        } | {"what": "the engine sleep under way at each job's add, and its wait (stage 'step')"}
        # the p99 of a few hundred samples is its slowest two or three: where their time went
        slowest = sorted(
            zip(rows, kinds, strict=True), key=lambda rk: -sum(x for x in rk[0] if x == x)
        )[:3]
        out["slowest"] = [
            {name: round(x * 1e3, 2) for (name, _), x in zip(STAGES, row, strict=True)}
            | {"in_flight": kind}
            for row, kind in slowest
        ]
        out["preempt_round_trip"] = _ms([s * 1e3 for s in self.preempt_s])
        slept = self.slept
        out["engine_sleep_overshoot"] = _ms([(end - at - asked) * 1e3 for at, asked, end in slept])
        out["engine_between_sleeps"] = _ms(
            [(b[0] - a[2]) * 1e3 for a, b in itertools.pairwise(slept)]
        ) | {"what": "one sleep's end to the next's start: stepping, GIL waits, idle waits"}
        out["gc_pause"] = _ms([s * 1e3 for s in self.gc_s])
        out["loop_lag"] = _ms([s * 1e3 for s in self.lag_s])
        out["loop_lags_over_20ms"] = sum(1 for s in self.lag_s if s > 0.02)
        return out


class WhatIfSim(SimEngine):
    """What-ifs of the engine's step (`--split`, `--cut-in`; not tokenyard's engines): with
    `split` > 0, while no high job runs and one was added within the last `window_s`, the
    running batch decodes in sub-steps of at most `split` sequences (each costs the decode
    base again), and a high job added meanwhile (`alone`) takes the next sub-step; with
    `cut_in`, a high job added during a step's prefill runs before that step's decode (an
    engine whose prefill and decode are separate forward passes)."""

    def __init__(self, *, split: int, cut_in: bool, window_s: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.split, self.cut_in, self.window_s = split, cut_in, window_s
        self._high: set[str] = set()
        self._high_at = float("-inf")
        self.on_prefill: Callable[[], None] = lambda: None  # before each prefill's sleep

    def add(self, request: EngineRequest) -> None:
        if request.priority == Priority.HIGH:
            with self._cond:
                self._high.add(request.seq_id)
                self._high_at = time.monotonic()
        super().add(request)

    def _late_alone(self) -> None:
        """Run the alone sequences added since the step began, before the rest of it."""
        with self._cond:
            late = [s for s in self._seqs.values() if s.alone and not s.prefilled]
            for s in late:
                s.prefilled = True
        if late:
            prompt = sum(len(s.input_ids) for s in late)
            self.on_prefill()
            self._sleep(self.prefill_base + self.prefill_per_token * prompt)
            self._sleep(self.decode_base + self.decode_per_seq * len(late))
            with self._cond:
                self._step_locked(late)

    def _loop(self) -> None:
        while True:
            with self._cond:
                if not self._wait_locked(self._seqs):
                    return
                self._high &= self._seqs.keys()
                batch = list(self._seqs.values())
                alone = [s for s in batch if s.alone and not s.prefilled]
                batch = alone or batch
                started = [s for s in batch if not s.prefilled]
                for s in started:
                    s.prefilled = True
                recent = time.monotonic() - self._high_at < self.window_s
                size = self.split if self.split and recent and not self._high else len(batch)
            if started:
                prompt = sum(len(s.input_ids) for s in started)
                self.on_prefill()
                self._sleep(self.prefill_base + self.prefill_per_token * prompt)
                if self.cut_in and not alone:
                    self._late_alone()
            for at in range(0, len(batch), max(1, size)):
                if at:
                    self._late_alone()
                part = batch[at : at + max(1, size)]
                self._sleep(self.decode_base + self.decode_per_seq * len(part))
                with self._cond:
                    self._step_locked(part)


def _ms(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "max": None}
    return {
        "p50": round(percentile(values, 50) or 0.0, 2),
        "p99": round(percentile(values, 99) or 0.0, 2),
        "max": round(max(values), 2),
    }


def _spec(priority: Priority, prompt: str, max_tokens: int, stream: bool = True) -> JobSpec:
    """A job as the gateway enqueues one: its prompt's token ids with it; `stream` False for
    a batch line (the Batches API's runner reads only results: no token events)."""
    return JobSpec(
        id=new_job_id(MODEL),
        model=MODEL,
        prompt=prompt,
        prompt_token_ids=SimTokenizer().encode(prompt),
        priority=priority,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        created_at=time.time(),
        stream=stream,
    )


async def _first_token(broker: Backend, job_id: str) -> None:
    after = "0"
    while True:
        for event_id, event in await broker.queue.read_events(job_id, after=after, block_s=1.0):
            after = event_id
            if isinstance(event, (TokenChunk, Finished)):
                return


async def _done(broker: Backend, job_id: str) -> None:
    after = "0"
    while True:
        for event_id, event in await broker.queue.read_events(job_id, after=after, block_s=1.0):
            after = event_id
            if isinstance(event, Finished):
                return


async def _ttfts(
    broker: Backend,
    n: int,
    tokens: int,
    gap_s: float,
    stages: Stages | None = None,
    jitter_s: float = 0.0,
) -> tuple[list[float], list[str]]:
    out, ids = [], []
    gaps = random.Random(n)  # the same gaps in every run: only where they land differs
    mark: Callable[[str, str], None] = stages.mark if stages is not None else lambda _a, _b: None
    for i in range(n):
        job = _spec(Priority.HIGH, f"urgent {i} {uuid.uuid4().hex[:6]}", tokens)
        if stages is not None:
            stages.marks[job.id] = {}
        started = time.perf_counter()
        mark(job.id, "sent")
        await broker.queue.enqueue(job)
        mark(job.id, "enqueued")
        await _first_token(broker, job.id)
        mark(job.id, "seen")
        out.append(time.perf_counter() - started)
        ids.append(job.id)
        await _done(broker, job.id)
        await asyncio.sleep(gap_s + gaps.uniform(0.0, jitter_s))
    return out, ids


async def _phase(url: str, args: argparse.Namespace, load: bool, preempt: bool) -> dict[str, Any]:
    """One run on a fresh worker: its TTFT samples, tokens, seconds, preemptions."""
    settings = BrokerSettings(url=url, prefix=f"pb{uuid.uuid4().hex[:8]}")
    broker = connect(settings)
    worker_broker = connect(settings)
    engine = (
        WhatIfSim(
            split=args.split,
            cut_in=args.cut_in,
            window_s=args.split_window_s,
            decode_base=args.step_s,
            decode_per_seq=args.step_per_seq_s,
        )
        if args.split or args.cut_in
        else SimEngine(decode_base=args.step_s, decode_per_seq=args.step_per_seq_s)
    )
    worker = Worker(
        worker_broker,
        engine,
        WorkerSettings(
            model=MODEL,
            engine="sim",
            max_seqs=args.max_seqs,
            batch_share=1.0,  # the batch lane may take every slot: the load saturates
            preempt_lanes="normal,low,batch" if preempt else "",
            alone_step_every=args.alone_every,
            prefill_cap_tokens=args.prefill_cap,
        ),
        freeze_heap=True,  # as `tokenyard worker` runs it (worker/run.py)
    )
    stages = Stages() if args.stages else None
    stop = asyncio.Event()
    if stages is not None:
        stages.attach(worker, engine)
        watching = asyncio.create_task(stages.watch(stop))
    task = asyncio.create_task(worker.run())
    try:
        await _ttfts(broker, 3, args.high_tokens, 0.0)  # warm-up
        batch: list[JobSpec] = []
        started = time.perf_counter()
        if load:
            batch = [
                _spec(
                    Priority.BATCH,
                    f"batch {i} ".ljust(args.batch_prompt_tokens, "x"),  # the sim: a byte a token
                    args.batch_tokens,
                    args.stream_batch,
                )
                for i in range(args.batch)
            ]
            await broker.queue.enqueue_many(batch)
            while worker.scheduler.running < args.max_seqs:
                await asyncio.sleep(0.005)
            # and decoding: with long prompts (--batch-prompt-tokens) their first prefill is a
            # step of its own, which would fall on the first high job of every round alike
            while engine.stats().tokens_generated < 3 * args.high_tokens + args.max_seqs:
                await asyncio.sleep(0.005)
        ttft, ids = await _ttfts(
            broker, args.high, args.high_tokens, args.gap_s, stages, args.gap_jitter_s
        )
        saturated = worker.scheduler.running >= args.max_seqs - 1 if load else None
        await asyncio.gather(*(_done(broker, job.id) for job in batch))
        took = time.perf_counter() - started
        tokens = len(batch) * args.batch_tokens + args.high * args.high_tokens
        records = await broker.queue.records([job.id for job in batch])
        return {
            "ttft": ttft,
            "seconds": took,
            "tokens": tokens,
            "preemptions": sum(r.preemptions for r in records if r is not None),
            "still_saturated_after_high_jobs": saturated,
            "stages": stages.summary(ids) if stages is not None else None,
        }
    finally:
        stop.set()
        if stages is not None:
            await watching
        worker.drain()
        await asyncio.wait_for(task, 60)
        await broker.close()
        await worker_broker.close()


def _pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The rounds' runs of one kind as one: TTFT samples pooled, tokens over seconds."""
    ttft = [t for run in runs for t in run["ttft"]]
    seconds = sum(run["seconds"] for run in runs)
    saturated = [run["still_saturated_after_high_jobs"] for run in runs]
    pooled: dict[str, Any] = {
        "ttft_s": {"count": len(ttft), "p50": percentile(ttft, 50), "p99": percentile(ttft, 99)},
        "seconds": round(seconds, 3),
        "tokens_per_s": round(sum(run["tokens"] for run in runs) / seconds, 1),
        "preemptions": sum(run["preemptions"] for run in runs),
        "still_saturated_after_high_jobs": None if saturated[0] is None else all(saturated),
    }
    if runs[0]["stages"] is not None:
        pooled["stages_ms"] = [run["stages"] for run in runs]
    return pooled


def _p99(run: dict[str, Any]) -> float:
    return percentile(run["ttft"], 99) or 0.0


async def run(url: str, args: argparse.Namespace) -> dict[str, Any]:
    idle: list[dict[str, Any]] = []
    loaded: list[dict[str, Any]] = []
    without: list[dict[str, Any]] = []
    for _ in range(args.rounds):  # in turn: the machine's load drifts over all three alike
        idle.append(await _phase(url, args, load=False, preempt=True))
        loaded.append(await _phase(url, args, load=True, preempt=True))
        without.append(await _phase(url, args, load=True, preempt=False))
    pooled_idle, pooled_loaded, pooled_without = _pooled(idle), _pooled(loaded), _pooled(without)
    p99 = pooled_idle["ttft_s"]["p99"]
    return {
        "benchmark": "preemption",
        "idle": pooled_idle,
        "loaded_with_preemption": pooled_loaded,
        "loaded_without_preemption": pooled_without,
        "ttft_p99_ratio_loaded_vs_idle": round(pooled_loaded["ttft_s"]["p99"] / p99, 3),
        "ttft_p99_ratio_without_preemption": round(pooled_without["ttft_s"]["p99"] / p99, 3),
        # the idle p99 plus one whole decode step of the full batch, over the idle p99: a high
        # job arriving as the batch's step begins waits all of it out (no engine cuts a step
        # short) and then takes the idle path. A ratio at or under this one is explained by
        # the step in flight alone (`in_flight` in --stages); one above it, by more
        "ttft_p99_ratio_idle_plus_one_step": round(
            (p99 + args.step_s + args.step_per_seq_s * args.max_seqs) / p99, 3
        ),
        "goal_ttft_p99_ratio_max": 1.5,
        "ttft_p99_ratio_per_round": [
            round(_p99(a) / _p99(b), 3) for a, b in zip(loaded, idle, strict=True)
        ],
        "tokens_per_s_ratio_vs_without": round(
            pooled_loaded["tokens_per_s"] / pooled_without["tokens_per_s"], 3
        ),
        "goal_tokens_per_s_ratio_min": 0.9,
        "settings": vars(args),
        "loadavg": loadavg(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--batch-tokens", type=int, default=200)
    parser.add_argument(
        "--batch-prompt-tokens",
        type=int,
        default=0,
        help="pad each batch prompt to this many tokens: a step that prefills one (a refill, a "
        "resumed victim) is that much longer, and a high job arriving during it waits it out",
    )
    parser.add_argument("--high", type=int, default=40)
    parser.add_argument("--high-tokens", type=int, default=8)
    parser.add_argument("--gap-s", type=float, default=0.02, help="between high-priority jobs")
    parser.add_argument(
        "--gap-jitter-s",
        type=float,
        default=0.0,
        help="add a uniform [0, this) to each gap: a fixed gap lands each high job at about the "
        "same point of the batch's step (20 ms is three 6.6 ms steps), this spreads them over it",
    )
    parser.add_argument("--max-seqs", type=int, default=16)
    parser.add_argument("--step-s", type=float, default=0.005, help="sim decode step, base")
    parser.add_argument("--step-per-seq-s", type=float, default=1e-4)
    parser.add_argument(
        "--rounds", type=int, default=5, help="idle, loaded and unpreempted runs, in turn"
    )
    parser.add_argument(
        "--stream-batch",
        action="store_true",
        help="batch jobs write token events each step (the Batches API's do not)",
    )
    parser.add_argument(
        "--alone-every",
        type=int,
        default=WorkerSettings().alone_step_every,
        help="the workers' alone_step_every: a high job's first step runs alone, at most once "
        "per this many steps; 0: off (its prefill joins the batch's step)",
    )
    parser.add_argument(
        "--prefill-cap",
        type=int,
        default=WorkerSettings().prefill_cap_tokens,
        help="the workers' prefill_cap_tokens: while a high job was claimed within the last "
        "second, an engine step prefills at most this many prompt tokens; 0: off",
    )
    parser.add_argument(
        "--switch-interval-ms",
        type=float,
        default=None,
        help="what-if: sys.setswitchinterval for this process (the worker's engine thread and "
        "event loop share the GIL; Python's default hands it over every 5 ms)",
    )
    parser.add_argument(
        "--split",
        type=int,
        default=0,
        help="what-if: while a high job was added within --split-window-s and none runs, the "
        "batch decodes in sub-steps of at most this many sequences, a high job taking the next",
    )
    parser.add_argument("--split-window-s", type=float, default=0.1)
    parser.add_argument(
        "--cut-in",
        action="store_true",
        help="what-if: a high job added during a step's prefill runs before that step's decode",
    )
    parser.add_argument("--stages", action="store_true", help="where the high jobs' time went")
    parser.add_argument("--quick", action="store_true", help="smoke sizes")
    args = parser.parse_args()
    if args.quick:
        args.batch, args.batch_tokens, args.high, args.max_seqs = 16, 120, 10, 4
        args.rounds = 1
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1000.0)
    with EmbeddedServer() as valkey:
        report = asyncio.run(run(valkey.url, args))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
