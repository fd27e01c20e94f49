"""Access-line overhead: what the gateway's per-request line costs, by log level and format.

The gateway's request middleware (tokenyard/gateway/instrument.py) around a trivial ASGI app
that answers 200 with an X-Job-Id, called in a loop in this process; the root handler writes
to a file, as a gateway's stderr redirected to a log would. CPU microseconds (a busy host
skews them less than wall time) per request for:
`warning` (the line is skipped by level: no record is made), `info_text` and `info_json`
(one line a request). The loop without the middleware is subtracted. Prints one JSON document.

    python -m bench.access_log [--requests 50000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from starlette.types import Receive, Scope, Send

from bench.common import loadavg
from tokenyard.gateway.instrument import RequestMetricsMiddleware
from tokenyard.logs import LogFormat, setup_logging
from tokenyard.metrics import GatewayMetrics

START = {"type": "http.response.start", "status": 200, "headers": [(b"x-job-id", b"j-1")]}
BODY = {"type": "http.response.body", "body": b"{}"}
SCOPE: Scope = {
    "type": "http",
    "method": "POST",
    "path": "/v1/completions",
    "query_string": b"",
    "client": ("127.0.0.1", 50000),
    "headers": [],
}


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    await send(START)
    await send(BODY)


async def receive() -> dict[str, Any]:
    return {"type": "http.request", "body": b"", "more_body": False}


async def send(message: Any) -> None:
    pass


async def per_request_us(handler: Any, requests: int) -> float:
    start = time.process_time()
    for _ in range(requests):
        await handler(dict(SCOPE), receive, send)
    return (time.process_time() - start) / requests * 1e6


async def run(requests: int) -> dict[str, Any]:
    middleware = RequestMetricsMiddleware(app, GatewayMetrics())
    bare = await per_request_us(app, requests)
    out: dict[str, Any] = {"requests": requests, "bare_app_us": round(bare, 2)}
    for name, level, fmt in (
        ("warning", "WARNING", LogFormat.TEXT),
        ("info_text", "INFO", LogFormat.TEXT),
        ("info_json", "INFO", LogFormat.JSON),
    ):
        setup_logging(level, fmt)
        await per_request_us(middleware, requests // 10)  # warm up
        out[f"{name}_us"] = round(await per_request_us(middleware, requests) - bare, 2)
    out["access_line_text_us"] = round(out["info_text_us"] - out["warning_us"], 2)
    out["access_line_json_us"] = round(out["info_json_us"] - out["warning_us"], 2)
    # for scale on a loaded host: one plain `log.info` line of the same words, same handler
    setup_logging("INFO", LogFormat.TEXT)
    plain = logging.getLogger("bench.plain")
    start = time.process_time()
    for _ in range(requests):
        plain.info("%s %s %d tenant=%s job_id=%s", "POST", "/v1/completions", 200, "t", "j-1")
    out["plain_log_line_us"] = round((time.process_time() - start) / requests * 1e6, 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=50_000)
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        log_file = Path(tmp) / "gateway.log"
        real_stderr = sys.stderr
        with log_file.open("w") as sink:
            sys.stderr = sink  # setup_logging's handler writes to sys.stderr
            try:
                result = asyncio.run(run(opts.requests))
            finally:
                sys.stderr = real_stderr
                logging.getLogger().handlers.clear()
        result["log_bytes"] = log_file.stat().st_size
    result["loadavg"] = loadavg()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
