"""Background responses: what reading a response later costs, against a sync call of the same size.

A gateway and a worker process on the sim engine (10 ms a decode step) over a private Valkey,
one request at a time, the modes interleaved so drift hits them alike:

  chat_sync          POST /v1/chat/completions, the answer when done (the baseline)
  response_sync      POST /v1/responses, the answer when done (stored as it ends)
  background_stream  POST /v1/responses background=true, then GET ?stream=true to its last event
  background_poll    POST /v1/responses background=true, then GET every `--poll-ms` until done

Each figure is client-side create-to-done latency in ms; `overhead_ms` is a mode's median minus
the baseline's.

    python -m bench.responses_background [--requests 50] [--tokens 16] [--poll-ms 10] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from bench.common import loadavg, percentile
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.fleet.launch import Launcher, Processes, free_port, wait_ready

MODEL = "sim-bench"
PROMPT = "The yard sorts every car onto its lane"


def modes(http: httpx.Client, tokens: int, poll_s: float) -> dict[str, Callable[[], None]]:
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": tokens,
        "cache": False,
    }
    response = {"model": MODEL, "input": PROMPT, "max_output_tokens": tokens}

    def chat_sync() -> None:
        http.post("/v1/chat/completions", json=chat).raise_for_status()

    def response_sync() -> None:
        http.post("/v1/responses", json=response).raise_for_status()

    def background_stream() -> None:
        created = http.post("/v1/responses", json={**response, "background": True})
        created.raise_for_status()
        url = f"/v1/responses/{created.json()['id']}"
        with http.stream("GET", url, params={"stream": "true"}) as events:
            for line in events.iter_lines():
                if line.startswith("event: response.") and line.endswith(
                    ("completed", "incomplete", "failed")
                ):
                    return
        raise RuntimeError("the stream ended without its last event")

    def background_poll() -> None:
        created = http.post("/v1/responses", json={**response, "background": True})
        created.raise_for_status()
        url = f"/v1/responses/{created.json()['id']}"
        while http.get(url).json()["status"] in ("queued", "in_progress"):
            time.sleep(poll_s)

    return {
        "chat_sync": chat_sync,
        "response_sync": response_sync,
        "background_stream": background_stream,
        "background_poll": background_poll,
    }


def summary(ms: list[float], baseline: float | None) -> dict[str, Any]:
    median = statistics.median(ms)
    out: dict[str, Any] = {
        "requests": len(ms),
        "median_ms": round(median, 2),
        "p90_ms": round(percentile(ms, 90) or 0.0, 2),
    }
    if baseline is not None:
        out["overhead_ms"] = round(median - baseline, 2)
    return out


def run(valkey: EmbeddedServer, requests: int, tokens: int, poll_s: float) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENYARD_")}
    port = free_port()
    with tempfile.TemporaryDirectory() as logs:
        procs = Processes(Path(logs))
        launcher = Launcher(procs, valkey.url, f"rb{uuid.uuid4().hex[:8]}")
        launcher.worker("--model", MODEL, "--engine", "sim", env=env, stdout=subprocess.DEVNULL)
        launcher.gateway(port, "--model", MODEL, "--engine", "sim", env=env)
        try:
            base = f"http://127.0.0.1:{port}"
            wait_ready(f"{base}/readyz", procs, timeout_s=120, interval_s=0.2)
            with httpx.Client(base_url=base, timeout=60) as http:
                calls = modes(http, tokens, poll_s)
                times: dict[str, list[float]] = {name: [] for name in calls}
                warmup = max(1, requests // 10)
                for i in range(warmup + requests):
                    for name, call in calls.items():
                        start = time.perf_counter()
                        call()
                        if i >= warmup:
                            times[name].append((time.perf_counter() - start) * 1000)
        finally:
            procs.stop(timeout_s=30)
    baseline = statistics.median(times["chat_sync"])
    return {
        name: summary(ms, None if name == "chat_sync" else baseline) for name, ms in times.items()
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=50, help="per mode, after a warm-up")
    parser.add_argument("--tokens", type=int, default=16, help="max_tokens of every request")
    parser.add_argument("--poll-ms", type=float, default=10.0)
    parser.add_argument("--quick", action="store_true", help="small sizes, to smoke-test")
    opts = parser.parse_args(argv)
    if opts.quick:
        opts.requests = 5
    result: dict[str, Any] = {
        "engine": "sim (10 ms a decode step)",
        "tokens": opts.tokens,
        "poll_ms": opts.poll_ms,
        "loadavg_before": loadavg(),
    }
    with tempfile.TemporaryDirectory() as tmp, EmbeddedServer(Path(tmp)) as valkey:
        result["modes"] = run(valkey, opts.requests, opts.tokens, opts.poll_ms / 1000)
    result["loadavg_after"] = loadavg()
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
