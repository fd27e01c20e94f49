"""Structured outputs' cost on the hf engine: a JSON schema on every request vs none.

One HFEngine in this process runs the same closed loop twice: `concurrency` requests kept in
flight (sampled, temperature 1, a seed each) until `requests` were issued, first with a JSON
schema (xgrammar: a token bitmask per constrained row and step, each token accepted by its
matcher), then without one. Each unconstrained request generates as many tokens as its
constrained twin did (ignore_eos), so both loops do the same work with the same batch
occupancy; the difference is the constraint's cost. Rounds alternate and the best of each
kind is reported, with every round's ratio.
Prints one JSON document: tokens/s of each, their ratio (the goal: >= 0.8), how many
constrained outputs validate against the schema, and the engine's mean batch.

    python -m bench.structured_outputs [--model tiny] [--concurrency 64] [--requests 256]
        [--device auto] [--threads 1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import time
from collections.abc import Sequence
from typing import Any

from bench.common import loadavg, percentile
from tokenyard.engines import EngineRequest
from tokenyard.engines.hf import HFEngine
from tokenyard.messages import EngineStats, FinishReason, Guide, SamplingParams

GOAL = 0.8
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "color", "tags", "active"],
    "additionalProperties": False,
}
MAX_TOKENS = 256  # above the longest output SCHEMA allows: every constrained request completes
PROMPTS = (
    "Describe a person as JSON:",
    "The queue holds every request until a worker has a free slot.",
    "Once upon a time there was a small model that wanted to write",
    "def add(a, b):",
)


def _valid(text: str) -> bool:
    try:
        import jsonschema

        jsonschema.validate(json.loads(text), SCHEMA)
    except ImportError:
        return bool(json.loads(text))
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


async def closed_loop(
    engine: HFEngine,
    prompts: Sequence[list[int]],
    params: Sequence[SamplingParams],
    concurrency: int,
    tag: str,
) -> dict[str, Any]:
    """Keep `concurrency` requests in flight through the engine API until all `params` ran."""
    done: dict[str, asyncio.Future[tuple[str, int, FinishReason | None]]] = {}
    texts: dict[str, list[str]] = {}
    tokens: dict[str, int] = {}

    async def route() -> None:
        while True:
            for out in await engine.outputs():
                texts.setdefault(out.seq_id, []).append(out.text)
                tokens[out.seq_id] = tokens.get(out.seq_id, 0) + len(out.token_ids)
                if out.finish_reason is not None and out.seq_id in done:
                    text = "".join(texts.pop(out.seq_id))
                    done[out.seq_id].set_result((text, tokens.pop(out.seq_id), out.finish_reason))

    issued = 0
    results: list[tuple[str, int, FinishReason | None, float]] = []
    lengths = [0] * len(params)  # output tokens, by request

    async def client() -> None:
        nonlocal issued
        loop = asyncio.get_running_loop()
        while issued < len(params):
            i = issued
            issued += 1
            sid = f"{tag}-{i}"
            done[sid] = loop.create_future()
            start = time.perf_counter()
            engine.add(EngineRequest(sid, prompts[i % len(prompts)], params[i]))
            text, n, reason = await done[sid]
            del done[sid]
            results.append((text, n, reason, time.perf_counter() - start))
            lengths[i] = n

    before = engine.stats()
    router = asyncio.create_task(route())
    start = time.perf_counter()
    try:
        await asyncio.gather(*(client() for _ in range(concurrency)))
    finally:
        router.cancel()
    wall = time.perf_counter() - start
    after = engine.stats()
    out_tokens = sum(n for _, n, _, _ in results)
    steps = after.steps - before.steps
    latency = [r[3] for r in results]
    return {
        "requests": len(results),
        "output_tokens": out_tokens,
        "mean_output_tokens": round(out_tokens / len(results), 1),
        "wall_s": round(wall, 3),
        "tokens_per_s": round(out_tokens / wall, 1),
        "mean_batch": round((after.sequences_stepped - before.sequences_stepped) / steps, 1)
        if steps
        else 0.0,
        "latency_ms_p50": round((percentile(latency, 50) or 0.0) * 1000, 1),
        "finish": {
            str(reason): sum(1 for r in results if r[2] is reason)
            for reason in {r[2] for r in results}
        },
        "_texts": [r[0] for r in results],
        "_lengths": lengths,
    }


def _stats_line(stats: EngineStats) -> dict[str, Any]:
    return {"kv_cache_usage": stats.kv_cache_usage, "running": stats.running}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    engine = HFEngine(
        args.model,
        device=args.device,
        max_seqs=args.concurrency,
        threads=args.threads,
    )
    await engine.start()
    try:
        tok = engine.tokenizer
        prompts = [tok.encode(p) for p in PROMPTS]
        guide = Guide(json=json.dumps(SCHEMA))

        def guided(i: int) -> SamplingParams:
            return SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=i, guide=guide)

        # warm-up: compiles the schema once (cached afterwards) and the engine's first steps
        warm = [guided(10_000 + i) for i in range(4)]
        await closed_loop(engine, prompts, warm, 4, "warm")
        # one cold compilation (the warm-up's is cached): a schema of another grammar
        other = json.loads(json.dumps(SCHEMA))
        other["properties"]["name"]["maxLength"] = 15
        compile_start = time.perf_counter()
        engine._guide_compiler().compile(Guide(json=json.dumps(other)))
        compile_s = time.perf_counter() - compile_start

        # Alternating rounds, the best of each kept: a shared host's noise moves single runs
        # by more than the constraint costs. Seeds repeat, so every round is the same work.
        constrained: dict[str, Any] = {}
        free: dict[str, Any] = {}
        rounds: list[float] = []
        guided_params = [guided(i) for i in range(args.requests)]
        for r in range(args.repeats):
            c = await closed_loop(engine, prompts, guided_params, args.concurrency, f"j{r}")
            c["valid"] = sum(_valid(t) for t in c.pop("_texts"))
            # Each free request generates as many tokens as its constrained twin: the same
            # lengths in the same order, so both loops have the same occupancy and tail.
            free_params = [
                SamplingParams(max_tokens=max(1, n), temperature=1.0, seed=i, ignore_eos=True)
                for i, n in enumerate(c.pop("_lengths"))
            ]
            f = await closed_loop(engine, prompts, free_params, args.concurrency, f"f{r}")
            del f["_texts"], f["_lengths"]
            rounds.append(round(c["tokens_per_s"] / f["tokens_per_s"], 3))
            if c["tokens_per_s"] > constrained.get("tokens_per_s", 0):
                constrained = c
            if f["tokens_per_s"] > free.get("tokens_per_s", 0):
                free = f
        ratio = constrained["tokens_per_s"] / free["tokens_per_s"] if free["tokens_per_s"] else 0
        return {
            "benchmark": "structured_outputs",
            "model": str(args.model),
            "device": str(engine.device),
            "dtype": str(engine.dtype).replace("torch.", ""),
            "vocab": engine.logits_vocab,
            "concurrency": args.concurrency,
            "requests": args.requests,
            "schema_compile_s": round(compile_s, 3),
            "json_schema": constrained,
            "free": free,
            "ratio": round(ratio, 3),
            "round_ratios": rounds,
            "goal": GOAL,
            "meets_goal": ratio >= GOAL,
            "host": {
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "loadavg": loadavg(),
                "threads": args.threads,
            },
        }
    finally:
        await engine.stop()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds of each")
    args = parser.parse_args(argv)
    print(json.dumps(asyncio.run(run(args)), indent=2))


if __name__ == "__main__":
    main()
