"""LoRA benchmark on the tiny model: four adapters mixed in one hf engine vs the base alone.

One HFEngine (continuous batching) with four PEFT adapters (`--lora`), driven through the
engine API by a closed loop of `--concurrency` sequences (fixed prompt, `--max-tokens` greedy
tokens, EOS ignored). Two workloads alternate, `--repeats` times each, on the same engine:

  base   every sequence runs the base model
  mixed  sequences go round-robin over the four adapters: every step mixes them

Prints one JSON document: tokens/s per run, the medians, and mixed / base (goal >= 0.8).

    python -m bench.lora_mix [--concurrency 16] [--requests 96] [--max-tokens 32]
        [--repeats 3] [--rank 8] [--threads 1] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from tokenyard.engines import EngineRequest
from tokenyard.engines.hf import HFEngine
from tokenyard.engines.tiny import ensure_tiny_model
from tokenyard.messages import SamplingParams

ADAPTERS = ("a1", "a2", "a3", "a4")
TARGET_MIXED_OVER_BASE = 0.8
PROMPT = "Once upon a time there was a small model that wanted to write poems about the sea."


def build_adapter(model: Path, out: Path, seed: int, rank: int) -> Path:
    """A PEFT LoRA on q, k, v and o of every layer, random non-zero weights."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False
    )
    peft_model = get_peft_model(base, config)
    peft_model.save_pretrained(str(out))
    return out


async def closed_loop(
    engine: HFEngine, adapters: list[str | None], requests: int, concurrency: int, tokens: int
) -> dict[str, Any]:
    """`requests` sequences, `concurrency` in flight, adapter i % len(adapters) each."""
    prompt = engine.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    started = 0
    in_flight = 0
    generated = 0
    run = f"r{time.monotonic_ns()}"

    def start_one() -> None:
        nonlocal started, in_flight
        adapter = adapters[started % len(adapters)]
        engine.add(EngineRequest(f"{run}-{started}", prompt, params, adapter=adapter))
        started += 1
        in_flight += 1

    t0, cpu0 = time.perf_counter(), time.process_time()
    while started < min(concurrency, requests):
        start_one()
    done = 0
    while done < requests:
        for out in await engine.outputs():
            generated += len(out.token_ids)
            if out.finish_reason is not None:
                done += 1
                in_flight -= 1
                if started < requests:
                    start_one()
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return {
        "tokens": generated,
        "seconds": round(elapsed, 3),
        "cpu_s": round(cpu, 3),
        "tokens_per_s": generated / elapsed,
        "tokens_per_cpu_s": generated / cpu,
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    model = ensure_tiny_model()
    with tempfile.TemporaryDirectory() as tmp:
        paths = {
            name: str(build_adapter(model, Path(tmp) / name, seed=i + 1, rank=args.rank))
            for i, name in enumerate(ADAPTERS)
        }
        engine = HFEngine(
            str(model),
            max_seqs=args.concurrency,
            max_tokens=args.concurrency * 1024,
            threads=args.threads,
            loras=paths,
            max_loras=len(ADAPTERS),
        )
        await engine.start()
        try:
            workloads: dict[str, list[str | None]] = {"base": [None], "mixed": list(ADAPTERS)}
            # warm: every adapter loaded, first-step allocations paid
            warm = min(8, args.concurrency)
            await closed_loop(engine, workloads["mixed"], warm, warm, 4)
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name in workloads}
            for _ in range(args.repeats):
                for name, adapters in workloads.items():  # alternating: drift hits both
                    runs[name].append(
                        await closed_loop(
                            engine, adapters, args.requests, args.concurrency, args.max_tokens
                        )
                    )
            widest = engine._lora.widest_pass if engine._lora is not None else 0
        finally:
            await engine.stop()
    medians = {
        name: statistics.median(r["tokens_per_s"] for r in results)
        for name, results in runs.items()
    }
    per_cpu = {
        name: statistics.median(r["tokens_per_cpu_s"] for r in results)
        for name, results in runs.items()
    }
    ratio = medians["mixed"] / medians["base"]
    cpu_ratio = per_cpu["mixed"] / per_cpu["base"]
    return {
        "bench": "lora_mix",
        "host": {"python": platform.python_version(), "machine": platform.machine()},
        "engine": "hf (continuous batching), CPU",
        "model": "tiny",
        "adapters": len(ADAPTERS),
        "rank": args.rank,
        "concurrency": args.concurrency,
        "requests_per_run": args.requests,
        "max_tokens": args.max_tokens,
        "threads": args.threads,
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "runs": {
            name: [
                {
                    **r,
                    "tokens_per_s": round(r["tokens_per_s"], 1),
                    "tokens_per_cpu_s": round(r["tokens_per_cpu_s"], 1),
                }
                for r in results
            ]
            for name, results in runs.items()
        },
        "median_tokens_per_s": {name: round(v, 1) for name, v in medians.items()},
        "mixed_over_base": round(ratio, 3),
        # the engine runs in this process on one torch thread: its CPU time is the cost of
        # the work, whatever else the host runs (wall time on a shared host is not)
        "median_tokens_per_cpu_s": {name: round(v, 1) for name, v in per_cpu.items()},
        "mixed_over_base_per_cpu_s": round(cpu_ratio, 3),
        "target_mixed_over_base": TARGET_MIXED_OVER_BASE,
        "meets_target": min(ratio, cpu_ratio) >= TARGET_MIXED_OVER_BASE,
        "most_adapters_in_one_pass": widest,
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny sizes")
    args = parser.parse_args(argv)
    if args.quick:
        args.concurrency, args.requests, args.max_tokens, args.repeats = 4, 8, 8, 1
    return args


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(parse())), indent=2))
