"""How much of its engine's own offline maximum tokenyard's HTTP path delivers.

For each concurrency C, with the same model, engine settings, prompts and output length
(greedy, fixed length via ignore_eos), one run measures side by side:

  transformers   the engine alone: `model.generate_batch` (transformers' own continuous
                 batching) with every request submitted at once, `max_requests_per_batch=C`.
  engine         tokenyard's HF engine called in this process, C sequences kept in flight
                 (no queue, no HTTP): what the engine wrapper costs.
  http           the product path: a private Valkey, `tokenyard gateway` and `tokenyard
                 worker --max-seqs C` subprocesses, C closed-loop clients streaming
                 /v1/completions. Its mean running batch comes from the worker's heartbeat.

The ratio that matters is http / max(transformers, engine) (goal >= 0.9). On a small CPU
host the gateway, Valkey and the load generator take cores the offline engine had to itself;
`--threads N` gives the engine N torch threads in every run, so the others can have the rest.

    python -m bench.engine_ceiling [--concurrency 64,256] [--max-tokens 64] [--prompt-words 32]
        [--device cpu|cuda] [--dtype float32|bfloat16] [--model tiny|/path] [--log-dir DIR]
        [--no-cuda-graphs] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench.common import proc_cpu_s
from tokenyard import heap
from tokenyard.bench.client import Endpoint, RequestOptions
from tokenyard.bench.report import level_report
from tokenyard.bench.runner import BenchSettings, Load, run_level
from tokenyard.bench.workload import LengthDist, Workload
from tokenyard.engines import EngineRequest
from tokenyard.fleet.launch import Launcher, Processes, free_port, wait_ready


def workload(opts: argparse.Namespace) -> Workload:
    return Workload(
        prompt_len=LengthDist(opts.prompt_words, opts.prompt_words),
        output_len=LengthDist(opts.max_tokens, opts.max_tokens),
    )


def prompts(opts: argparse.Namespace, n: int, encode: Any) -> list[list[int]]:
    """The same prompts the HTTP clients send, as token ids."""
    specs = workload(opts).requests(f"{opts.seed}:0")
    ids: list[list[int]] = []
    for spec in specs:
        ids.append(list(encode(spec.prompt)))
        if len(ids) == n:
            break
    while len(ids) < n:  # a workload yields as many as asked for; repeat if it stops early
        ids.append(ids[len(ids) % max(1, len(ids))])
    return ids


# -- the engine alone ------------------------------------------------------------------------


def offline_transformers(opts: argparse.Namespace, c: int, n: int) -> dict[str, Any]:
    """transformers' own `generate_batch`: all requests at once, C per batch."""
    import torch
    from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

    from tokenyard.engines.hf_tokenizer import load_hf_tokenizer, resolve_model_path

    path = resolve_model_path(opts.model)
    tok = load_hf_tokenizer(path)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[opts.dtype]
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation="sdpa", local_files_only=True
    ).to(opts.device)
    model.eval()
    inputs = prompts(opts, n, tok.encode)
    longest = max(len(p) for p in inputs) + opts.max_tokens
    page = 64
    config = GenerationConfig(
        max_new_tokens=opts.max_tokens,
        do_sample=False,
        eos_token_id=-1,  # fixed length, as the HTTP clients' ignore_eos
        pad_token_id=tok.pad_token_id,
    )
    cb = ContinuousBatchingConfig(
        page_size=page,
        num_blocks=c * (-(-longest // page) + 1),
        max_batch_tokens=opts.max_batch_tokens or max(512, c),
        max_requests_per_batch=c,
        use_cuda_graph=opts.device.startswith("cuda") and opts.cuda_graphs,
    )
    model.generate_batch(inputs[: min(8, n)], config, cb, progress_bar=False)  # warm-up
    start = time.perf_counter()
    outputs = model.generate_batch(inputs, config, cb, progress_bar=False)
    wall = time.perf_counter() - start
    tokens = sum(len(o.generated_tokens) for o in outputs.values())
    del model
    if opts.device.startswith("cuda"):
        torch.cuda.empty_cache()  # the engine sizes its KV cache from the free memory it finds
    return {
        "requests": n,
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "tok_s": round(tokens / wall, 1),
    }


async def offline_engine(opts: argparse.Namespace, c: int, n: int) -> dict[str, Any]:
    """tokenyard's HF engine in this process, C sequences kept in flight."""
    from tokenyard.engines import make_engine
    from tokenyard.messages import SamplingParams

    engine = make_engine(
        "hf",
        model=opts.model,
        device=opts.device,
        dtype=opts.dtype,
        max_seqs=c,
        cuda_graphs=opts.cuda_graphs,
    )
    await engine.start()
    params = SamplingParams(max_tokens=opts.max_tokens, temperature=0.0, ignore_eos=True)
    inputs = prompts(opts, n, engine.tokenizer.encode)

    async def run(batch: list[list[int]], tag: str) -> tuple[int, float]:
        todo = list(enumerate(batch))
        live = 0
        tokens = 0
        while todo and live < c:
            i, ids = todo.pop(0)
            engine.add(EngineRequest(f"{tag}{i}", ids, params))
            live += 1
        start = time.perf_counter()
        while live:
            for out in await engine.outputs():
                tokens += len(out.token_ids)
                if out.finish_reason is not None:
                    live -= 1
                    if todo:
                        i, ids = todo.pop(0)
                        engine.add(EngineRequest(f"{tag}{i}", ids, params))
                        live += 1
        return tokens, time.perf_counter() - start

    try:
        await run(inputs[: min(8, n)], "warm")
        before = engine.stats()
        cpu = time.process_time()
        tokens, wall = await run(inputs, "run")
        cpu = time.process_time() - cpu  # every thread of this process: the engine's own work
        after = engine.stats()
    finally:
        await engine.stop()
    steps = after.steps - before.steps
    mean_batch = (after.sequences_stepped - before.sequences_stepped) / steps if steps else 0.0
    return {
        "requests": n,
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "tok_s": round(tokens / wall, 1),
        "mean_batch": round(mean_batch, 2),
        "cpu_s": round(cpu, 2),
    }


# -- the HTTP path ---------------------------------------------------------------------------


class Stack:
    """A private Valkey, one gateway and one worker, from the product's own CLI."""

    def __init__(self, opts: argparse.Namespace, c: int, log_dir: Path) -> None:
        from tokenyard.broker.redis.embedded import EmbeddedServer

        self.opts = opts
        self.c = c
        self.log_dir = log_dir
        self.server = EmbeddedServer(log_dir / "valkey").start()
        self.prefix = f"ec{uuid.uuid4().hex[:8]}"
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        metrics_port = free_port()  # the worker's Prometheus metrics: stage times, batch
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        env = {
            **os.environ,
            "TOKENYARD_WORKER_DEVICE": opts.device,
            "TOKENYARD_WORKER_DTYPE": opts.dtype,
            "TOKENYARD_WORKER_TOKEN_BUDGET": str(c * (4 * opts.prompt_words + opts.max_tokens)),
            "TOKENYARD_WORKER_ENGINE_PROCESS": "1" if opts.engine_process else "0",
            "TOKENYARD_WORKER_CUDA_GRAPHS": "true" if opts.cuda_graphs else "false",
            "TOKENYARD_WORKER_METRICS_PORT": str(metrics_port),
        }
        if opts.threads:
            env["TOKENYARD_WORKER_THREADS"] = str(opts.threads)
        self.processes = Processes(log_dir)
        launcher = Launcher(self.processes, self.server.url, self.prefix)
        launcher.worker("--model", opts.model, "--engine", "hf", "--max-seqs", str(c), env=env)
        launcher.gateway(self.port, "--model", opts.model, "--engine", "hf", env=env)

    async def wait_ready(self, timeout_s: float = 180.0) -> None:
        await asyncio.to_thread(
            wait_ready, f"{self.base}/readyz", self.processes, timeout_s=timeout_s, interval_s=0.2
        )

    async def worker_histograms(self) -> dict[str, tuple[float, float]]:
        """(sum, count) of each of the worker's histograms, from its /metrics."""
        from urllib.request import urlopen

        from prometheus_client.parser import text_string_to_metric_families

        def scrape() -> str:
            with urlopen(self.metrics_url, timeout=10) as reply:
                return str(reply.read().decode())

        found: dict[str, list[float]] = {}
        for family in text_string_to_metric_families(await asyncio.to_thread(scrape)):
            for sample in family.samples:
                for end, at in (("_sum", 0), ("_count", 1)):
                    if sample.name.endswith(end) and family.type == "histogram":
                        found.setdefault(sample.name.removesuffix(end), [0.0, 0.0])[at] = (
                            sample.value
                        )
        return {name: (pair[0], pair[1]) for name, pair in found.items()}

    async def worker_mean_batch(self) -> float | None:
        from tokenyard.broker import connect
        from tokenyard.config import BrokerSettings

        broker = connect(BrokerSettings(url=self.server.url, prefix=self.prefix))
        try:
            await asyncio.sleep(2.5)  # one heartbeat after the load
            infos = await broker.registry.workers(self.opts.model)
        finally:
            await broker.close()
        return infos[0].mean_batch if infos else None

    def stop(self) -> None:
        self.processes.stop(timeout_s=60)
        self.server.stop()


async def http_path(opts: argparse.Namespace, c: int, n: int, tmp: Path) -> dict[str, Any]:
    log_dir = tmp / f"c{c}"
    log_dir.mkdir(parents=True, exist_ok=True)
    stack = Stack(opts, c, log_dir)
    try:
        await stack.wait_ready()

        def settings(requests: int, seed: int) -> BenchSettings:
            return BenchSettings(
                base_url=f"{stack.base}/v1",
                options=RequestOptions(
                    endpoint=Endpoint.completions,
                    model=opts.model,
                    ignore_eos=True,
                    temperature=0.0,
                ),
                workload=workload(opts),
                requests=requests,
                seed=seed,
                timeout_s=600.0,
            )

        await run_level(settings(min(8, n), opts.seed + 1), Load("closed", min(8, c)))  # warm-up
        pids = stack.processes.pids()
        pids["valkey"] = stack.server.pid or 0
        cpu0 = {name: proc_cpu_s(pid) for name, pid in pids.items()}
        client0 = time.process_time()
        hist0 = await stack.worker_histograms()
        report = level_report(await run_level(settings(n, opts.seed), Load("closed", c)))
        cpu = {name: proc_cpu_s(pid) - cpu0[name] for name, pid in pids.items()}
        cpu["client"] = time.process_time() - client0
        hist1 = await stack.worker_histograms()
        mean_batch = await stack.worker_mean_batch()
    finally:
        stack.stop()
    return {
        "requests": report["requests"],
        "tokens": report["tokens"]["output"],
        "wall_s": report["duration_s"],
        "tok_s": report["throughput"]["output_tokens_per_s"],
        # over the measured run alone (the heartbeat's is since the worker started, warm-up
        # at 8 concurrent included)
        "mean_batch": _run_mean(hist0, hist1, "tokenyard_worker_batch_size", 1.0),
        "mean_batch_since_start": mean_batch,
        "ttft_ms": {k: report["ttft_ms"].get(k) for k in ("p50", "p99")},
        # the worker's share of a returning job's way back into the batch, mean ms per job
        # (per step for step and publish) over the measured run
        "worker_ms": {
            name: _run_mean(hist0, hist1, f"tokenyard_worker_{metric}", 1e3)
            for name, metric in (
                ("enqueue_to_claim", "claim_wait_seconds"),
                ("claim_to_engine", "claim_to_engine_seconds"),
                ("engine_add_to_first_token", "first_step_seconds"),
                ("step", "step_seconds"),
                ("publish", "publish_seconds"),
            )
        },
        # where a small host spends itself: CPU seconds per process over the measured run
        "cpu_s": {name: round(seconds, 2) for name, seconds in cpu.items()},
        "errors": report["errors"],
    }


def _run_mean(
    before: dict[str, tuple[float, float]],
    after: dict[str, tuple[float, float]],
    name: str,
    scale: float,
) -> float | None:
    """A histogram's mean over the observations between two scrapes."""
    total0, count0 = before.get(name, (0.0, 0.0))
    total1, count1 = after.get(name, (0.0, 0.0))
    if count1 <= count0:
        return None
    return round(scale * (total1 - total0) / (count1 - count0), 3)


# -- main ------------------------------------------------------------------------------------


async def main_async(opts: argparse.Namespace) -> dict[str, Any]:
    # the offline runs get the worker's process settings: its malloc tuning (tokenyard.heap)
    # and its torch threads
    heap.retain_freed_memory()
    if opts.threads:
        import torch

        torch.set_num_threads(opts.threads)  # the offline runs get what the worker's engine gets
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="engine-ceiling-") as tmp:
        logs = Path(opts.log_dir or tmp)  # the gateway's, worker's and Valkey's logs
        for c in opts.concurrency:
            n = max(c, opts.requests_per_slot * c)
            cell: dict[str, Any] = {}
            cell["transformers"] = await asyncio.to_thread(offline_transformers, opts, c, n)
            cell["engine"] = await offline_engine(opts, c, n)
            cell["http"] = await http_path(opts, c, n, logs)
            ceiling = max(cell["transformers"]["tok_s"], cell["engine"]["tok_s"])
            cell["http_over_offline_max"] = round(cell["http"]["tok_s"] / ceiling, 3)
            cell["engine_over_transformers"] = round(
                cell["engine"]["tok_s"] / cell["transformers"]["tok_s"], 3
            )
            # the two shares of the gap the worker controls, whatever else takes the host's
            # cores: how full it keeps the batch, and its CPU per token over the engine's alone
            http, engine = cell["http"], cell["engine"]
            if http["mean_batch"] and engine["mean_batch"]:
                cell["batch_fill_vs_engine"] = round(http["mean_batch"] / engine["mean_batch"], 3)
            if engine["cpu_s"] > 0 and http["tokens"]:
                per_token = http["cpu_s"]["worker"] / http["tokens"]
                cell["worker_cpu_per_token_vs_engine"] = round(
                    per_token / (engine["cpu_s"] / engine["tokens"]), 3
                )
            results[str(c)] = cell
    return {
        "benchmark": "engine_ceiling",
        "model": opts.model,
        "device": opts.device,
        "dtype": opts.dtype,
        "prompt_words": opts.prompt_words,
        "max_tokens": opts.max_tokens,
        "torch_threads": opts.threads,
        "engine_process": opts.engine_process,
        "cuda_graphs": opts.cuda_graphs,
        "cores": os.cpu_count(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "goal": {"http_over_offline_max": 0.9},
        "results": results,
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", default="64,256")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=32)
    parser.add_argument("--requests-per-slot", type=int, default=2)
    parser.add_argument("--max-batch-tokens", type=int, default=None)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--engine-process", action="store_true")
    parser.add_argument(
        "--no-cuda-graphs",
        dest="cuda_graphs",
        action="store_false",
        help="CUDA: run every forward pass eagerly, offline and in the worker",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads for the engine, offline and in the worker (default: torch's)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", help="keep the processes' logs here (default: a temp dir)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: C=4, 8 tokens")
    opts = parser.parse_args(argv)
    opts.concurrency = [int(x) for x in str(opts.concurrency).split(",")]
    if opts.quick:
        opts.concurrency, opts.max_tokens, opts.prompt_words = [4], 8, 8
    return opts


def main(argv: list[str] | None = None) -> None:
    print(json.dumps(asyncio.run(main_async(parse(argv))), indent=2))


if __name__ == "__main__":
    main()
