"""Batching over HTTP on the tiny model: one-at-a-time vs static vs continuous, and the ceiling.

Each mode gets its own stack: a private Valkey (AOF everysec, shared, one key prefix per
mode), a gateway subprocess (`python -m tokenyard gateway --model tiny --engine hf`: the
product's entry point) and one worker subprocess running tokenyard's Worker on the mode's
engine, built here so its batching parameters can be set (the CLI has no batch_size):

  one-at-a-time  HFStaticEngine(batch_size=1, batch_timeout_ms=0, max_seqs=1): one
                 model.generate per request, the design of a naive worker.
  static         HFStaticEngine(batch_size=C, batch_timeout_ms=20, max_seqs=2C): size-or-time
                 micro-batches, sized to the closed loop (their best case).
  continuous     HFEngine(max_seqs=C): transformers continuous batching (tokenyard's default).

Load comes from tokenyard.bench's runner (streamed /v1/completions, fixed prompt and output
length, greedy, ignore_eos) in this process:

  saturation   closed loop, C clients, for a fixed time: output tokens/s.
  common rate  open-loop Poisson at half the continuous mode's saturation req/s, the same for
               every mode: p99 TTFT (skipped, marked overloaded, where a mode's saturation
               throughput is below the rate: its queue and TTFT would grow without bound).
  own rate     open-loop Poisson at half the mode's own saturation req/s: p99 TTFT at equal
               relative load.

The ceiling is HFEngine(max_seqs=C) called directly in this process with every request
submitted at once (no HTTP, no queue). Prints one JSON document.

    python -m bench.http_batching [--concurrency 32] [--max-tokens 64] [--quick] [--plot out.png]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.common import loadavg, proc_cpu_s
from tokenyard.bench.client import Endpoint, RequestOptions
from tokenyard.bench.report import level_report
from tokenyard.bench.runner import BenchSettings, Load, run_level
from tokenyard.bench.workload import LengthDist, Workload
from tokenyard.config import BrokerSettings, WorkerSettings
from tokenyard.engines import EngineRequest
from tokenyard.fleet.launch import Launcher, Processes, free_port, wait_ready

if TYPE_CHECKING:
    from tokenyard.engines.base import Engine

MODEL = "tiny"
MODES = ("continuous", "static", "one-at-a-time")  # continuous first: it sets the common rate
STATIC_TIMEOUT_MS = 20.0


def make_engine(mode: str, concurrency: int, threads: int) -> Engine:
    """The engine of one mode (see the module docstring)."""
    from tokenyard.engines.hf import HFEngine
    from tokenyard.engines.hf_static import HFStaticEngine

    if mode == "one-at-a-time":
        return HFStaticEngine(
            MODEL, batch_size=1, batch_timeout_ms=0.0, max_seqs=1, threads=threads
        )
    if mode == "static":
        return HFStaticEngine(
            MODEL,
            batch_size=concurrency,
            batch_timeout_ms=STATIC_TIMEOUT_MS,
            max_seqs=2 * concurrency,
            threads=threads,
        )
    if mode == "continuous":
        return HFEngine(MODEL, max_seqs=concurrency, threads=threads)
    raise ValueError(f"unknown mode {mode!r}")


def describe_engine(mode: str, concurrency: int) -> str:
    return {
        "one-at-a-time": "hf-static batch_size=1 batch_timeout_ms=0 max_seqs=1",
        "static": f"hf-static batch_size={concurrency} batch_timeout_ms={STATIC_TIMEOUT_MS:g} "
        f"max_seqs={2 * concurrency}",
        "continuous": f"hf (transformers continuous batching) max_seqs={concurrency}",
    }[mode]


# -- the worker subprocess -------------------------------------------------------------------


def worker_main(url: str, prefix: str, mode: str, concurrency: int, threads: int) -> None:
    """One worker on the mode's engine; SIGTERM drains it."""
    from tokenyard.broker import connect
    from tokenyard.worker.run import run_worker
    from tokenyard.worker.worker import Worker

    async def serve() -> None:
        engine = make_engine(mode, concurrency, threads)
        settings = WorkerSettings(
            model=MODEL, engine=engine.name, max_seqs=engine.capacity.max_seqs, threads=threads
        )
        broker = connect(BrokerSettings(url=url, prefix=prefix))
        await run_worker(broker, Worker(broker, engine, settings))

    asyncio.run(serve())


# -- one mode's stack ------------------------------------------------------------------------


class Stack:
    """Gateway and worker subprocesses of one mode; SIGTERM stops them (the worker drains)."""

    def __init__(self, log_dir: Path, url: str, mode: str, opts: argparse.Namespace) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.processes = Processes(log_dir)
        self.launcher = Launcher(self.processes, url, f"hb{uuid.uuid4().hex[:8]}")
        self.worker = [
            sys.executable, "-m", "bench.http_batching", "--run-worker", mode,
            *self.launcher.broker_args,
            "--concurrency", str(opts.concurrency), "--threads", str(opts.threads),
        ]  # fmt: skip

    def signal(self) -> None:
        self.processes.send_signal()

    def pids(self) -> dict[str, int]:
        return self.processes.pids()

    def start(self) -> None:
        self.processes.start("worker", self.worker)
        self.launcher.gateway(self.port, "--model", MODEL, "--engine", "hf")

    async def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Poll /readyz: the gateway answers and sees the worker (its model is loaded)."""
        await asyncio.to_thread(
            wait_ready, f"{self.base}/readyz", self.processes, timeout_s=timeout_s
        )

    def stop(self) -> None:
        self.processes.stop(timeout_s=60.0)


@contextlib.asynccontextmanager
async def running(
    tmp: Path, url: str, modes: Sequence[str], opts: argparse.Namespace
) -> AsyncIterator[dict[str, Stack]]:
    """Every mode's stack, started together (start-up is the slow part; an idle stack costs
    well under 1% of a core) and stopped together."""
    stacks: dict[str, Stack] = {}
    try:
        for mode in modes:
            log_dir = tmp / mode
            log_dir.mkdir(parents=True, exist_ok=True)
            stacks[mode] = Stack(log_dir, url, mode, opts)
            stacks[mode].start()
        for stack in stacks.values():
            await stack.wait_ready()
        yield stacks
    finally:
        for stack in stacks.values():
            stack.signal()  # all drain at once
        for stack in stacks.values():
            stack.stop()


# -- measurements ----------------------------------------------------------------------------


def workload(opts: argparse.Namespace) -> Workload:
    return Workload(
        prompt_len=LengthDist(opts.prompt_words, opts.prompt_words),
        output_len=LengthDist(opts.max_tokens, opts.max_tokens),
    )


def bench_settings(
    opts: argparse.Namespace, base: str, *, requests: int | None, duration_s: float | None
) -> BenchSettings:
    return BenchSettings(
        base_url=f"{base}/v1",
        options=RequestOptions(
            endpoint=Endpoint.completions, model=MODEL, ignore_eos=True, temperature=0.0
        ),
        workload=workload(opts),
        requests=requests,
        duration_s=duration_s,
        seed=opts.seed,
        timeout_s=opts.timeout_s,
    )


def brief(level: dict[str, Any]) -> dict[str, Any]:
    """The fields of tokenyard.bench's level report this benchmark reads."""
    return {
        "load": level["load"],
        "requests": level["requests"],
        "duration_s": level["duration_s"],
        "throughput": level["throughput"],
        "output_tokens": level["tokens"]["output"],
        "ttft_ms": level["ttft_ms"],
        "itl_ms": level["itl_ms"],
        "e2e_ms": level["e2e_ms"],
        "errors": level["errors"],
        "error_examples": level["error_examples"],
    }


async def measure_mode(
    stack: Stack,
    mode: str,
    opts: argparse.Namespace,
    common_rate: float | None,
    server_pid: int | None,
) -> dict[str, Any]:
    """Warm-up, saturation, then the open-loop levels, on one running stack."""
    c = opts.concurrency
    out: dict[str, Any] = {"engine": describe_engine(mode, c), "loadavg_start": loadavg()}
    # first forward passes and batch shapes are slow; they are not the steady state
    warm = bench_settings(opts, stack.base, requests=c, duration_s=None)
    await run_level(warm, Load("closed", c), level=100)

    pids = {**stack.pids(), "valkey": server_pid}
    cpu0 = {name: proc_cpu_s(pid) for name, pid in pids.items()}
    client0 = time.process_time()
    sat = bench_settings(opts, stack.base, requests=None, duration_s=opts.saturation_s)
    saturation = level_report(await run_level(sat, Load("closed", c), level=0))
    tokens = saturation["tokens"]["output"]
    out["saturation"] = brief(saturation)
    # CPU seconds per 1000 output tokens, per process: where a 2-core host spends itself
    cpu = {name: proc_cpu_s(pid) - cpu0[name] for name, pid in pids.items()}
    cpu["client"] = time.process_time() - client0
    out["saturation"]["cpu_s_per_1k_tokens"] = {
        name: round(seconds * 1000 / tokens, 3) if tokens else None for name, seconds in cpu.items()
    }
    sat_rps = saturation["throughput"]["requests_per_s"]

    async def open_loop(rate: float, level: int) -> dict[str, Any]:
        # enough arrivals for a p99 of some meaning, and a bounded run time
        count = max(opts.min_open_requests, round(rate * opts.open_s))
        settings = bench_settings(opts, stack.base, requests=count, duration_s=None)
        cell = brief(level_report(await run_level(settings, Load("open", rate), level=level)))
        # a run that needed far longer than its arrivals did not keep up (the host slowed, or
        # the rate is too high): its TTFT then measures a growing queue; count / rate is the
        # arrivals' expected span (Poisson: the real one varies by a few seconds)
        cell["expected_arrival_span_s"] = round(count / rate, 3)
        cell["tail_s"] = round(cell["duration_s"] - count / rate, 3)
        return cell

    rate = common_rate if common_rate is not None else opts.rate_fraction * sat_rps
    if sat_rps < rate * 1.05:
        out["common_rate"] = {"rate": round(rate, 3), "overloaded": True,
                              "saturation_requests_per_s": sat_rps}  # fmt: skip
    else:
        out["common_rate"] = {"rate": round(rate, 3), "overloaded": False,
                              **(await open_loop(rate, 1))}  # fmt: skip
    own = opts.rate_fraction * sat_rps
    out["own_rate"] = {"rate": round(own, 3), **(await open_loop(own, 2))}
    out["loadavg_end"] = loadavg()
    return out


async def offline_ceiling(opts: argparse.Namespace) -> dict[str, Any]:
    """HFEngine driven directly: every request submitted at once, tokens/s over the batch."""
    from tokenyard.engines.hf import HFEngine
    from tokenyard.messages import SamplingParams

    engine = HFEngine(MODEL, max_seqs=opts.concurrency, threads=opts.threads)
    await engine.start()
    try:
        specs = workload(opts).requests(f"{opts.seed}:offline")
        params = SamplingParams(max_tokens=opts.max_tokens, temperature=0.0, ignore_eos=True)

        async def batch(n: int, tag: str) -> tuple[float, int]:
            prompts = [engine.tokenizer.encode(next(specs).prompt) for _ in range(n)]
            started = time.perf_counter()
            # engines run what they are given: keep them at capacity, no more
            todo = list(enumerate(prompts))[::-1]
            for _ in range(min(len(todo), engine.capacity.max_seqs)):
                i, prompt = todo.pop()
                engine.add(EngineRequest(f"{tag}{i}", prompt, params))
            done = tokens = 0
            while done < n:
                for out in await engine.outputs():
                    tokens += len(out.token_ids)
                    if out.finish_reason is not None:
                        done += 1
                        if todo:
                            i, prompt = todo.pop()
                            engine.add(EngineRequest(f"{tag}{i}", prompt, params))
            return time.perf_counter() - started, tokens

        await batch(opts.concurrency, "warm")
        n = opts.offline_requests
        wall, tokens = await batch(n, "run")
    finally:
        await engine.stop()
    return {
        "engine": describe_engine("continuous", opts.concurrency),
        "requests": n,
        "output_tokens": tokens,
        "wall_s": round(wall, 3),
        "output_tokens_per_s": round(tokens / wall, 1),
        "requests_per_s": round(n / wall, 2),
    }


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def ratios(results: dict[str, Any], offline: dict[str, Any] | None) -> dict[str, Any]:
    def tps(mode: str) -> float | None:
        cell = results.get(mode)
        return cell["saturation"]["throughput"]["output_tokens_per_s"] if cell else None

    def ttft99(mode: str, key: str) -> float | None:
        cell = results.get(mode, {}).get(key, {})
        value: float | None = cell.get("ttft_ms", {}).get("p99")
        return value

    out: dict[str, Any] = {
        "tokens_per_s": {
            "continuous_over_static": ratio(tps("continuous"), tps("static")),
            "continuous_over_one_at_a_time": ratio(tps("continuous"), tps("one-at-a-time")),
            "static_over_one_at_a_time": ratio(tps("static"), tps("one-at-a-time")),
        },
        "p99_ttft": {
            key: {
                "static_over_continuous": ratio(ttft99("static", key), ttft99("continuous", key)),
                "one_at_a_time_over_continuous": ratio(
                    ttft99("one-at-a-time", key), ttft99("continuous", key)
                ),
            }
            for key in ("common_rate", "own_rate")
        },
    }
    if offline is not None:
        out["tokens_per_s"]["continuous_http_over_offline"] = ratio(
            tps("continuous"), offline["output_tokens_per_s"]
        )
    return out


def plot(report: dict[str, Any], path: Path) -> None:
    """Bars: saturation tokens/s per mode (and the offline ceiling); p99 TTFT per mode."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    results = report["results"]
    modes = [m for m in ("one-at-a-time", "static", "continuous") if m in results]
    figure = Figure(figsize=(11, 4.5), layout="constrained")
    FigureCanvasAgg(figure)
    left, right = figure.subplots(1, 2)
    names = [*modes]
    values = [results[m]["saturation"]["throughput"]["output_tokens_per_s"] for m in modes]
    if report["offline_ceiling"] is not None:
        names.append("offline\nceiling")
        values.append(report["offline_ceiling"]["output_tokens_per_s"])
    bars = left.bar(names, values, color=["#999", "#d95f02", "#1b9e77", "#7570b3"][: len(names)])
    left.bar_label(bars, fmt="%.0f")
    left.set_title(f"saturation: {report['config']['concurrency']} closed-loop clients")
    left.set_ylabel("output tokens/s")
    width = 0.38
    series = ((-width / 2, "common_rate", "common rate", "C0"),
              (width / 2, "own_rate", "half own saturation", "C1"))  # fmt: skip
    for offset, key, label, color in series:
        labelled = False
        for i, mode in enumerate(modes):
            cell = results[mode].get(key, {})
            p99 = cell.get("ttft_ms", {}).get("p99")
            if p99 is None:  # overloaded: not run, its p99 has no bound
                right.annotate("overloaded", (i + offset, 1.0), xycoords=("data", "axes fraction"),
                               xytext=(0, -4), textcoords="offset points", ha="center", va="top",
                               rotation=90, fontsize=8)  # fmt: skip
                continue
            bar = right.bar([i + offset], [p99], width, color=color,
                            label=None if labelled else label)  # fmt: skip
            labelled = True
            right.bar_label(bar, fmt="%.0f", fontsize=8)
    right.set_xticks(range(len(modes)), modes)
    right.set_yscale("log")
    right.set_ylabel("p99 TTFT (ms, log)")
    right.set_title("p99 time to first token, open-loop Poisson")
    right.legend()
    figure.suptitle("tokenyard over HTTP, tiny model")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)


async def run(opts: argparse.Namespace) -> dict[str, Any]:
    from tokenyard.broker.redis.embedded import EmbeddedServer
    from tokenyard.engines.tiny import ensure_tiny_model

    started = time.perf_counter()
    load_before = loadavg()
    ensure_tiny_model()  # once, before any subprocess could race to build it
    offline = await offline_ceiling(opts) if opts.offline else None
    results: dict[str, Any] = {}
    common_rate: float | None = None
    with tempfile.TemporaryDirectory(prefix="ty-hb-") as tmp, EmbeddedServer() as server:
        async with running(Path(tmp), server.url, opts.modes, opts) as stacks:
            for mode, stack in stacks.items():
                cell = await measure_mode(stack, mode, opts, common_rate, server.pid)
                results[mode] = cell
                if common_rate is None:
                    common_rate = cell["common_rate"]["rate"]
    import torch
    import transformers

    errors = sum(
        level["requests"]["failed"]
        for cell in results.values()
        for level in (cell["saturation"], cell["common_rate"], cell["own_rate"])
        if "requests" in level
    )
    return {
        "benchmark": "http_batching",
        "config": {
            "model": MODEL,
            "modes": list(opts.modes),
            "concurrency": opts.concurrency,
            "max_tokens": opts.max_tokens,
            "prompt_words": opts.prompt_words,
            "sampling": "greedy, ignore_eos: every request generates exactly max_tokens",
            "torch_threads": opts.threads,
            "saturation_s": opts.saturation_s,
            "open_loop": f"Poisson, max({opts.min_open_requests}, rate * {opts.open_s:g} s) "
            f"requests; common rate = {opts.rate_fraction:g} x the first mode's saturation "
            f"req/s; own rate = {opts.rate_fraction:g} x the mode's own",
            "engines": {m: describe_engine(m, opts.concurrency) for m in MODES},
            "stack": "per mode, all started before the first measurement: gateway subprocess "
            "(python -m tokenyard gateway --engine hf), one worker subprocess (tokenyard "
            "Worker on the mode's engine), shared private Valkey (AOF everysec); clients: "
            "tokenyard.bench runner in this process, streamed /v1/completions",
            "offline": "HFEngine in this process, every request added at once (no HTTP, queue)",
            "host": {
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "loadavg_before": load_before,
                "loadavg_after": loadavg(),
            },
        },
        "offline_ceiling": offline,
        "results": results,
        "ratios": ratios(results, offline),
        "all_completed": errors == 0,
        "wall_s": round(time.perf_counter() - started, 1),
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    # None marks "not given": --quick picks its own values for those.
    p.add_argument("--concurrency", type=int, help="closed-loop clients, batch size (default 32)")
    p.add_argument("--max-tokens", type=int, help="output tokens per request (default 64)")
    p.add_argument("--prompt-words", type=int, default=16, help="about as many tokens")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per engine")
    p.add_argument("--saturation-s", type=float, help="closed-loop seconds (default 15)")
    p.add_argument("--open-s", type=float, help="open-loop arrivals span (default 15 s)")
    p.add_argument("--min-open-requests", type=int, help="per open-loop level (default 40)")
    p.add_argument("--rate-fraction", type=float, default=0.5)
    p.add_argument("--offline-requests", type=int, help="for the ceiling (default 4 x C)")
    p.add_argument("--no-offline", dest="offline", action="store_false")
    p.add_argument("--modes", default=",".join(MODES), help="run in this order")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=300.0, help="per request")
    p.add_argument("--plot", type=Path, help="bar chart PNG (matplotlib)")
    p.add_argument("--quick", action="store_true", help="~60 s smoke run")
    # the worker subprocess's own entry point
    p.add_argument("--run-worker", metavar="MODE", help=argparse.SUPPRESS)
    p.add_argument("--broker", help=argparse.SUPPRESS)
    p.add_argument("--prefix", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    quick = {"concurrency": 8, "max_tokens": 16, "saturation_s": 4.0, "open_s": 4.0,
             "min_open_requests": 12}  # fmt: skip
    full = {"concurrency": 32, "max_tokens": 64, "saturation_s": 15.0, "open_s": 15.0,
            "min_open_requests": 40}  # fmt: skip
    for name, value in (quick if a.quick else full).items():
        if getattr(a, name) is None:
            setattr(a, name, value)
    if a.offline_requests is None:
        a.offline_requests = 4 * a.concurrency
    a.modes = tuple(m for m in a.modes.split(",") if m)
    for m in a.modes:
        if m not in MODES:
            p.error(f"unknown mode {m!r}; expected {', '.join(MODES)}")
    if a.concurrency < 1 or a.max_tokens < 1:
        p.error("--concurrency and --max-tokens must be at least 1")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_args(argv)
    from transformers.utils import logging as hf_logging

    # the CB manager logs a warning per start/stop; the JSON on stdout is the output
    hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    if opts.run_worker:
        worker_main(opts.broker, opts.prefix, opts.run_worker, opts.concurrency, opts.threads)
        return 0
    report = asyncio.run(run(opts))
    print(json.dumps(report, indent=2))
    if opts.plot is not None:
        plot(report, opts.plot)
    return 0 if report["all_completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
