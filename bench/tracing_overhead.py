"""Tracing overhead: what OpenTelemetry tracing costs a request, off (the default) and on.

Two measurements, one JSON document:

  hooks       the tracing hooks one job passes through (gateway: request span, admission and
              enqueue spans, carrying the context; worker: claim, start, settle with its
              queue/job/claim/prefill/decode/complete spans), called in a loop in this process:
              microseconds per job with tracing off, and on (SDK, batch processor, an exporter
              that drops the spans, so the figure is tokenyard's cost, not the network's); the
              loop's own cost (making the job) is subtracted.
  light_load  `tokenyard serve --engine sim` answering one request at a time over HTTP, traces
              off, then on (OTLP/HTTP to a sink in this process): end-to-end latency.

    python -m bench.tracing_overhead [--jobs 20000] [--requests 200] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from bench.common import loadavg, percentile
from tokenyard import tracing
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.fleet.launch import Processes, free_port, tokenyard_command, wait_ready
from tokenyard.messages import JobResult, JobSpec, JobStatus

HEADERS = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}


def baseline_per_job_us(jobs: int) -> float:
    """The loop below without its hooks: making the job, reading the clocks."""
    start = time.perf_counter()
    for i in range(jobs):
        JobSpec(id=f"j{i}", model="m", created_at=time.time())
    return (time.perf_counter() - start) / jobs * 1e6


def hooks_per_job_us(jobs: int) -> float:
    """Microseconds the tracing hooks add to one job, gateway and worker side together."""
    spans = tracing.JobSpans("bench")
    result = JobResult(status=JobStatus.SUCCEEDED, prompt_tokens=8, completion_tokens=16)
    start = time.perf_counter()
    for i in range(jobs):
        spec = JobSpec(id=f"j{i}", model="m", created_at=time.time())
        held = tracing.hold()  # the request middleware's: the span ends with the response
        with tracing.server_span("POST /v1/completions", HEADERS):
            with tracing.span("tokenyard.admission"):
                pass
            tracing.carry(spec, HEADERS)
            with tracing.span("tokenyard.enqueue", **{"tokenyard.job_id": spec.id}):
                pass
        if held is not None:
            tracing.release(held)
        if tracing.enabled():  # the worker makes JobSpans only when tracing is on
            now = time.time()
            mono = time.monotonic()
            spans.claimed([spec], now, now)
            spans.started(spec.id)
            spans.settled([(spec, result, mono, mono)], [True], now, now)
    return (time.perf_counter() - start) / jobs * 1e6


def hooks(jobs: int) -> dict[str, Any]:
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    class Drop(SpanExporter):
        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    base = baseline_per_job_us(jobs)
    off = hooks_per_job_us(jobs) - base
    tracing.configure("bench", Drop())
    try:
        on = hooks_per_job_us(jobs) - base
    finally:
        tracing.shutdown()
    return {"jobs": jobs, "off_us_per_job": round(off, 2), "on_us_per_job": round(on, 2)}


def _sink() -> ThreadingHTTPServer:
    class Sink(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def serve_latencies(valkey: EmbeddedServer, requests: int, otlp: str | None) -> list[float]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TOKENYARD_", "OTEL_"))}
    env.update(
        TOKENYARD_BROKER_URL=valkey.url,
        TOKENYARD_BROKER_PREFIX=f"bt{port}",
        TOKENYARD_WORKER_ENGINE="sim",
        TOKENYARD_GATEWAY_PORT=str(port),
    )
    if otlp:
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = otlp
    with tempfile.TemporaryDirectory() as data:
        procs = Processes()
        procs.start("serve", tokenyard_command("serve", "--data-dir", data), env=env,
                    stdout=subprocess.DEVNULL)  # fmt: skip
        try:
            base = f"http://127.0.0.1:{port}"
            wait_ready(f"{base}/readyz", procs, timeout_s=120, interval_s=0.2)
            with httpx.Client(base_url=base, timeout=60) as client:
                body = {"model": "tiny", "prompt": "hello", "max_tokens": 8, "ignore_eos": True}
                times = []
                for i in range(requests + requests // 10):
                    start = time.perf_counter()
                    reply = client.post("/v1/completions", json=body, headers=HEADERS)
                    reply.raise_for_status()
                    if i >= requests // 10:  # the first tenth warms up
                        times.append((time.perf_counter() - start) * 1000)
                return times
        finally:
            procs.stop(timeout_s=60)


def summary(ms: list[float]) -> dict[str, Any]:
    return {
        "requests": len(ms),
        "median_ms": round(statistics.median(ms), 3),
        "p90_ms": round(percentile(ms, 90) or 0.0, 3),
        "p99_ms": round(percentile(ms, 99) or 0.0, 3),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="small sizes, to smoke-test")
    opts = parser.parse_args(argv)
    if opts.quick:
        opts.jobs, opts.requests = 500, 10
    result: dict[str, Any] = {"hooks": hooks(opts.jobs), "loadavg_before": loadavg()}
    sink = _sink()
    with tempfile.TemporaryDirectory() as tmp, EmbeddedServer(Path(tmp)) as valkey:
        off = serve_latencies(valkey, opts.requests, None)
        on = serve_latencies(valkey, opts.requests, f"http://127.0.0.1:{sink.server_address[1]}")
    sink.shutdown()
    result["light_load"] = {
        "off": summary(off),
        "on": summary(on),
        "median_overhead_ms": round(statistics.median(on) - statistics.median(off), 3),
    }
    result["loadavg_after"] = loadavg()
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
