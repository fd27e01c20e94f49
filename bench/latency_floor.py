"""The latency floor of the gateway's hops: the same parts (uvicorn, Valkey streams, a worker
process on the SimEngine) with no tokenyard code between them.

  server  a raw ASGI app under uvicorn, run as the gateway is (http and loop auto: httptools
          and uvloop here; access log off). POST: one pipeline of XADD {key} (reply key, body)
          and XREAD BLOCK on that request's own reply key, so a request costs one write to
          Valkey and its reply wakes its own handler. Chosen over one shared reply stream read
          by a background task, which adds a hand-off per reply from that task to the handler
          (not measured here). GET answers 200 (readiness).
  worker  XREADGROUP BLOCK on {key} (group "floor"), one request at a time: the engine API as
          the bench's `Direct` calls it (add, outputs() until finished), then one pipeline of
          XADD reply + PEXPIRE + XACK + XDEL.
  relay   the worker's place in front of an upstream (`--upstream URL`): each request's body
          POSTed to an OpenAI-compatible server on one kept-alive aiohttp session, its answer
          (status and body) the reply, many requests at once (a task each), as tokenyard's
          remote engine runs them. bench/upstream_overhead.py's `floor` target.

Keys are `{key}`, `{key}:ready` and `{key}:reply:<hex>` (expiring), in the benchmark's Valkey
beside the product's keys (a bench, so not in tokenyard/broker/redis/keys.py). Started by
bench/gateway_overhead.py and bench/upstream_overhead.py through `start_floor`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import redis.asyncio as aioredis

if TYPE_CHECKING:
    import aiohttp

    from tokenyard.engines.sim import SimEngine
    from tokenyard.fleet.launch import Processes

GROUP = "floor"
REPLY_TTL_MS = 60_000
BLOCK_MS = 30_000  # a server handler gives up (504) after this; the worker re-blocks
# redis-py's default socket timeout (5 s) would cut a blocking read short: a worker idle that
# long died of it, and a server's request waiting behind a slow one answered 500
NO_TIMEOUT: dict[str, Any] = {"socket_timeout": None}

SELF_COMMAND = [sys.executable, "-m", "bench.latency_floor"]


def server_command(url: str, key: str, port: int) -> list[str]:
    return [*SELF_COMMAND, "--run-floor-server", url, key, "--port", str(port)]


def worker_command(url: str, key: str, engine_options: dict[str, Any]) -> list[str]:
    return [*SELF_COMMAND, "--run-floor-worker", url, key,
            "--engine-options", json.dumps(engine_options)]  # fmt: skip


def relay_command(url: str, key: str, upstream: str) -> list[str]:
    """The worker that relays each request to `upstream` (a full URL: base and path)."""
    return [*SELF_COMMAND, "--run-floor-worker", url, key, "--upstream", upstream]


async def start_floor(
    procs: Processes, url: str, key: str, port: int, worker: Sequence[str]
) -> tuple[int, int]:
    """The floor's server on `port` and its worker (`worker_command` or `relay_command`),
    started and ready (the server answers GET, the worker has said it reads); their pids."""
    import httpx

    client = aioredis.Redis.from_url(url, **NO_TIMEOUT)
    try:
        await create_group(client, key)
        relay = procs.start("floor-worker", worker)
        server = procs.start("floor-server", server_command(url, key, port))
        give_up = time.monotonic() + 60.0
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5.0) as http:
            while True:
                procs.check()
                with contextlib.suppress(httpx.HTTPError):
                    up = (await http.get("/")).status_code == 200
                    if up and await client.exists(ready_key(key)):
                        return server.pid, relay.pid
                if time.monotonic() > give_up:
                    raise TimeoutError("the latency floor's server or worker did not start")
                await asyncio.sleep(0.1)
    finally:
        await client.aclose()


def ready_key(key: str) -> str:
    return f"{key}:ready"


async def create_group(client: aioredis.Redis, key: str) -> None:
    """The worker's consumer group from the stream's start: requests sent before the worker
    reads are still delivered to it."""
    await client.xgroup_create(key, GROUP, id="0", mkstream=True)


# -- the server ------------------------------------------------------------------------------


class FloorApp:
    """Raw ASGI: POST puts the body on the stream and answers the worker's reply as JSON."""

    def __init__(self, url: str, key: str) -> None:
        self.url, self.key = url, key
        self.redis: aioredis.Redis | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    self.redis = aioredis.Redis.from_url(self.url, **NO_TIMEOUT)
                    await self.redis.ping()
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    if self.redis is not None:
                        await self.redis.aclose()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        status, body = 200, b'{"ok":true}'
        if scope["method"] == "POST":
            status, body = await self.relay(await read_body(receive))
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode())]  # fmt: skip
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def relay(self, request: bytes) -> tuple[int, bytes]:
        assert self.redis is not None
        reply_key = f"{self.key}:reply:{uuid.uuid4().hex}"
        # one write: the XREAD blocks in Valkey right behind the XADD
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xadd(self.key, {"reply": reply_key, "body": request})
            pipe.xread({reply_key: "0"}, count=1, block=BLOCK_MS)
            _, reply = await pipe.execute()
        if not reply:
            return 504, b'{"error":{"message":"no reply from the floor worker"}}'
        fields: dict[bytes, bytes] = reply[0][1][0][1]
        return int(fields[b"status"]), fields[b"body"]


async def read_body(receive: Any) -> bytes:
    body, more = b"", True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    return body


def server_main(url: str, key: str, port: int) -> None:
    import uvicorn

    # what tokenyard's gateway command passes (cli._run_gateway); http and loop stay "auto"
    uvicorn.run(
        FloorApp(url, key), host="127.0.0.1", port=port, log_level="warning", access_log=False
    )


# -- the worker ------------------------------------------------------------------------------


async def serve_worker(url: str, key: str, engine_options: dict[str, Any]) -> None:
    """Answer requests one at a time until the process ends."""
    from tokenyard.engines.sim import SimEngine

    engine = SimEngine(**engine_options)
    await engine.start()
    client = aioredis.Redis.from_url(url, **NO_TIMEOUT)
    consumer = f"w{uuid.uuid4().hex[:6]}"
    try:
        await client.set(ready_key(key), consumer)
        while True:
            got: Any = await client.xreadgroup(GROUP, consumer, {key: ">"}, count=1, block=BLOCK_MS)
            for _, entries in got or ():
                for entry_id, fields in entries:
                    body = await answer(engine, entry_id.decode(), json.loads(fields[b"body"]))
                    await write_reply(client, key, entry_id, fields[b"reply"], 200, body)
    finally:
        await client.aclose()
        await engine.stop()


async def answer(engine: SimEngine, seq_id: str, request: dict[str, Any]) -> str:
    """Run one request on the engine as the bench's `Direct` does; its completion as JSON."""
    from tokenyard.engines.base import EngineRequest
    from tokenyard.messages import SamplingParams

    params = SamplingParams(
        max_tokens=int(request["max_tokens"]),
        temperature=float(request.get("temperature", 1.0)),
        ignore_eos=bool(request.get("ignore_eos", False)),
    )
    engine.add(EngineRequest(seq_id, engine.tokenizer.encode(request["prompt"]), params))
    tokens: list[int] = []
    finish: str | None = None
    while finish is None:
        for out in await engine.outputs():
            if out.seq_id == seq_id:
                tokens += out.token_ids
                if out.finish_reason is not None:
                    finish = out.finish_reason.value
    text = engine.tokenizer.decode(tokens)
    return json.dumps(completion(seq_id, request, text, finish, len(tokens)))


async def serve_relay(url: str, key: str, upstream: str) -> None:
    """Relay requests to `upstream`, each in a task of its own, until the process ends."""
    import aiohttp

    client = aioredis.Redis.from_url(url, **NO_TIMEOUT)
    consumer = f"r{uuid.uuid4().hex[:6]}"
    running: set[asyncio.Task[None]] = set()
    connector = aiohttp.TCPConnector(limit=0)  # as many kept connections as requests in flight
    try:
        async with aiohttp.ClientSession(connector=connector) as http:
            await client.set(ready_key(key), consumer)
            while True:
                got: Any = await client.xreadgroup(
                    GROUP, consumer, {key: ">"}, count=256, block=BLOCK_MS
                )
                for _, entries in got or ():
                    for entry_id, fields in entries:
                        task = asyncio.create_task(
                            relay(client, http, upstream, key, entry_id, fields)
                        )
                        running.add(task)
                        task.add_done_callback(running.discard)
    finally:
        await client.aclose()


async def relay(
    client: aioredis.Redis,
    http: aiohttp.ClientSession,
    upstream: str,
    key: str,
    entry_id: bytes,
    fields: dict[bytes, bytes],
) -> None:
    """One request through the upstream; its answer written back as the worker's is."""
    headers = {"Content-Type": "application/json"}
    async with http.post(upstream, data=fields[b"body"], headers=headers) as response:
        status, body = response.status, await response.read()
    await write_reply(client, key, entry_id, fields[b"reply"], status, body)


async def write_reply(
    client: aioredis.Redis,
    key: str,
    entry_id: bytes,
    reply_key: bytes,
    status: int,
    body: str | bytes,
) -> None:
    """A request's answer on its reply stream (expiring), the request taken off `key`: one
    pipeline."""
    async with client.pipeline(transaction=False) as pipe:
        pipe.xadd(reply_key, {"status": status, "body": body})
        pipe.pexpire(reply_key, REPLY_TTL_MS)
        pipe.xack(key, GROUP, entry_id)
        pipe.xdel(key, entry_id)
        await pipe.execute()


def completion(
    seq_id: str, request: dict[str, Any], text: str, finish: str, tokens: int
) -> dict[str, Any]:
    """An OpenAI text completion, as the gateway's sync answer has it."""
    return {
        "id": f"cmpl-{seq_id}",
        "object": "text_completion",
        "model": request.get("model"),
        "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
        "usage": {"prompt_tokens": 0, "completion_tokens": tokens, "total_tokens": tokens},
    }


def worker_main(url: str, key: str, engine_options: dict[str, Any]) -> None:
    """Runs until SIGTERM ends the process (nothing of it needs draining)."""
    asyncio.run(serve_worker(url, key, engine_options))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    role = p.add_mutually_exclusive_group(required=True)
    role.add_argument("--run-floor-server", action="store_true")
    role.add_argument("--run-floor-worker", action="store_true")
    p.add_argument("url", help="Valkey URL")
    p.add_argument("key", help="the request stream's key")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--engine-options", default="{}", help="SimEngine keyword arguments (JSON)")
    p.add_argument("--upstream", help="worker: relay each request to this URL, no engine")
    a = p.parse_args(argv)
    if a.run_floor_server:
        server_main(a.url, a.key, a.port)
    elif a.upstream:
        asyncio.run(serve_relay(a.url, a.key, a.upstream))
    else:
        worker_main(a.url, a.key, json.loads(a.engine_options))
    return 0


if __name__ == "__main__":
    sys.exit(main())
