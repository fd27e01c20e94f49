"""Run one load level or a sweep of them, with a live progress bar."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from tokenyard.bench.arrivals import closed_loop_budget, poisson_offsets
from tokenyard.bench.client import RequestOptions, RequestResult, send_request
from tokenyard.bench.stats import rate
from tokenyard.bench.workload import RequestSpec, Workload

LIVE_REFRESH_S = 0.25

Sender = Callable[[RequestSpec], Coroutine[Any, Any, RequestResult]]


@dataclass(frozen=True)
class Load:
    """One load level: open loop at `value` requests/s, or closed loop with `value` clients."""

    mode: Literal["open", "closed"]
    value: float

    def __post_init__(self) -> None:
        if not self.value > 0:
            raise ValueError(f"load must be positive, got {self.value}")
        if self.mode == "closed" and (math.isinf(self.value) or self.value != int(self.value)):
            raise ValueError(f"closed-loop clients must be a whole number, got {self.value}")

    def describe(self) -> str:
        if self.mode == "open":
            return f"{self.value:g} req/s"
        return f"{int(self.value)} client{'s' if self.value != 1 else ''}"

    def as_dict(self) -> dict[str, Any]:
        if self.mode == "open":
            return {"mode": "open", "rate": self.value}
        return {"mode": "closed", "concurrency": int(self.value)}


@dataclass(frozen=True)
class BenchSettings:
    """Everything a run needs besides the load levels."""

    base_url: str
    options: RequestOptions
    workload: Workload
    requests: int | None = 100
    duration_s: float | None = None
    api_key: str | None = None
    seed: int = 0
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.requests is None and self.duration_s is None:
            raise ValueError("give a request count, a duration, or both")
        if self.requests is not None and self.requests < 1:
            raise ValueError("the request count must be at least 1")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError("the duration must be positive")


@dataclass
class LevelRun:
    """The raw outcome of one load level."""

    load: Load
    results: list[RequestResult]
    wall_s: float


@dataclass
class _Live:
    """Running counts behind the progress bar's live text."""

    started: float
    ok: int = 0
    failed: int = 0
    tokens: int = 0
    in_flight: int = 0
    errors: Counter[str] = field(default_factory=Counter)

    def chunk(self, count: int) -> None:
        self.tokens += count

    def finished(self, result: RequestResult) -> None:
        self.in_flight -= 1
        # the streamed chunk count was an estimate; the usage total replaces it
        self.tokens += result.output_tokens - len(result.chunk_times)
        if result.ok:
            self.ok += 1
        else:
            self.failed += 1
            self.errors[result.error or "unknown"] += 1

    def text(self, now: float) -> str:
        elapsed = now - self.started
        errors = " ".join(f"{k} x{v}" for k, v in self.errors.most_common(3))
        return (
            f"[green]ok {self.ok}[/] [red]err {self.failed}[/]"
            f"{f' ({errors})' if errors else ''} · in flight {self.in_flight} · "
            f"{rate(self.ok, elapsed):.2f} req/s · {rate(self.tokens, elapsed):.0f} tok/s"
        )


def make_progress(console: Console | None = None, *, disable: bool = False) -> Progress:
    """A progress display with live throughput and error counts (on stderr by default)."""
    return Progress(
        SpinnerColumn(),
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[live]}"),
        console=console or Console(stderr=True),
        disable=disable,
    )


def _client(settings: BenchSettings, load: Load) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
    # enough connections that the client never queues requests itself, which would show up
    # as server latency; a closed loop needs exactly one per client
    connections = int(load.value) if load.mode == "closed" else None
    return httpx.AsyncClient(
        base_url=settings.base_url,
        headers=headers,
        timeout=httpx.Timeout(settings.timeout_s),
        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
    )


async def run_level(
    settings: BenchSettings,
    load: Load,
    *,
    level: int = 0,
    progress: Progress | None = None,
) -> LevelRun:
    """Send one level's requests and wait for every one of them to finish."""
    # each level draws fresh prompts, so a response cache cannot answer a later level
    specs = settings.workload.requests(f"{settings.seed}:{level}")
    start = time.perf_counter()
    live = _Live(started=start)
    task: TaskID | None = None
    ticker: asyncio.Task[None] | None = None
    if progress is not None:
        task = progress.add_task(load.describe(), total=settings.requests, live="")
        ticker = asyncio.create_task(_tick(progress, task, live))
    try:
        async with _client(settings, load) as client:

            async def one(spec: RequestSpec) -> RequestResult:
                live.in_flight += 1
                result = await send_request(client, spec, settings.options, live.chunk)
                live.finished(result)
                if progress is not None and task is not None:
                    progress.advance(task)
                return result

            if load.mode == "open":
                results = await _open_loop(settings, load.value, specs, one, level)
            else:
                results = await _closed_loop(settings, int(load.value), specs, one)
    finally:
        if ticker is not None:
            ticker.cancel()
    end = max((r.end_s for r in results), default=time.perf_counter())
    if progress is not None and task is not None:
        progress.update(task, total=len(results), completed=len(results), live=live.text(end))
    results.sort(key=lambda r: r.index)
    return LevelRun(load=load, results=results, wall_s=end - start)


async def _tick(progress: Progress, task: TaskID, live: _Live) -> None:
    while True:
        progress.update(task, live=live.text(time.perf_counter()))
        await asyncio.sleep(LIVE_REFRESH_S)


async def _open_loop(
    settings: BenchSettings,
    rate_per_s: float,
    specs: Iterator[RequestSpec],
    one: Sender,
    level: int,
) -> list[RequestResult]:
    rng = random.Random(f"tokenyard-bench:arrivals:{settings.seed}:{level}")
    offsets = poisson_offsets(
        rate_per_s, rng, count=settings.requests, duration_s=settings.duration_s
    )
    loop = asyncio.get_running_loop()
    start = loop.time()
    tasks: list[asyncio.Task[RequestResult]] = []
    async with asyncio.TaskGroup() as group:
        for offset, spec in zip(offsets, specs, strict=False):
            # sleep to absolute send times so scheduling delays do not accumulate
            delay = start + offset - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(group.create_task(one(spec)))
    return [t.result() for t in tasks]


async def _closed_loop(
    settings: BenchSettings, clients: int, specs: Iterator[RequestSpec], one: Sender
) -> list[RequestResult]:
    loop = asyncio.get_running_loop()
    budget = closed_loop_budget(
        loop.time(), count=settings.requests, duration_s=settings.duration_s
    )
    results: list[RequestResult] = []

    async def client_loop() -> None:
        while budget.take(loop.time()):
            results.append(await one(next(specs)))

    async with asyncio.TaskGroup() as group:
        for _ in range(clients):
            group.create_task(client_loop())
    return results


async def run_sweep(
    settings: BenchSettings, loads: Sequence[Load], *, progress: Progress | None = None
) -> list[LevelRun]:
    """Run each load level in turn (one at a time, so they do not disturb each other)."""
    return [
        await run_level(settings, load, level=index, progress=progress)
        for index, load in enumerate(loads)
    ]
