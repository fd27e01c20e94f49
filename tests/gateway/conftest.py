"""A real gateway stack per test: uvicorn on a free port, Valkey, and in-process sim workers.

The stack runs in a background thread with its own event loop, so tests can use blocking
clients (httpx, openai) as well as async ones from the test's loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import uvicorn

from tokenyard.broker import Backend, connect
from tokenyard.broker.redis import connection_of
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.config import BrokerSettings, WorkerSettings
from tokenyard.engines.base import Engine, EngineTokenizer
from tokenyard.engines.sim import SimEngine, SimTokenizer
from tokenyard.gateway import GatewaySettings, create_app
from tokenyard.gateway.auth import KeyRing
from tokenyard.worker.worker import Worker

MODEL = "sim-model"


def fast_engine() -> Engine:
    return SimEngine(
        prefill_base=0.001, prefill_per_token=0.0, decode_base=0.002, decode_per_seq=0.0
    )


class BareSim(SimEngine):
    """A sim engine with none of the optional decoding features: what a request needing one
    meets on an engine that lacks it."""

    name = "bare-sim"
    features = frozenset()


def slow_engine(step_s: float = 0.05) -> Callable[[], Engine]:
    return lambda: SimEngine(
        prefill_base=0.001, prefill_per_token=0.0, decode_base=step_s, decode_per_seq=0.0
    )


@dataclass
class Stack:
    """A running gateway (and its workers); `url` is its base URL."""

    url: str
    prefix: str
    model: str
    broker_settings: BrokerSettings
    loop: asyncio.AbstractEventLoop
    gateway_broker: Backend
    worker_options: dict[str, Any]
    workers: list[tuple[Worker, asyncio.Task[None], Backend]] = field(default_factory=list)

    def client(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kwargs.pop("timeout", 30.0), **kwargs)

    def call(self, coro: Any, timeout: float = 30.0) -> Any:
        """Run a coroutine on the stack's loop (e.g. a broker query) and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start_worker(self, engine: Engine) -> Worker:
        broker = connect(self.broker_settings)
        options: dict[str, Any] = {
            "model": self.model,
            "engine": "sim",
            "heartbeat_s": 0.2,
            "claim_block_s": 0.2,
            **self.worker_options,
        }
        name = f"w{len(self.workers)}-{self.prefix}"
        worker = Worker(broker, engine, WorkerSettings(**options), consumer=name)
        self.workers.append((worker, asyncio.create_task(worker.run()), broker))
        return worker

    def start_worker(self, engine: Engine | None = None) -> Worker:
        """Start one more in-process worker on the stack's loop."""
        worker: Worker = self.call(self._start_worker(engine or fast_engine()))
        return worker

    async def _stop_workers(self) -> None:
        for worker, _, _ in self.workers:
            worker.drain()
        await _join_workers([task for _, task, _ in self.workers])
        for _, _, broker in self.workers:
            await broker.close()

    def job_ids(self, model: str = MODEL) -> list[str]:
        """Ids of every job of `model` under this stack's prefix (the prefix is per test)."""
        broker = self.gateway_broker

        async def scan() -> list[str]:
            pattern = broker.queue.keys.job_prefix(model) + "*"
            found = [
                k.decode() async for k in connection_of(broker).client.scan_iter(match=pattern)
            ]
            return [k.rsplit(":", 1)[-1] for k in found]

        ids: list[str] = self.call(scan())
        return ids


def _free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


async def _join_workers(tasks: list[asyncio.Task[None]], timeout: float = 10.0) -> None:
    """Wait for drained workers to return.

    On Python 3.11, redis-py can swallow a task's cancel (asyncio.wait_for's race), which
    leaves a worker's upkeep loop running after Worker.run cancelled it; cancel it again.
    """
    loop = asyncio.get_running_loop()
    give_up = loop.time() + timeout
    while not all(t.done() for t in tasks) and loop.time() < give_up:
        await asyncio.sleep(0.05)
        for t in asyncio.all_tasks():
            if t.get_name() in ("upkeep", "outputs") and t.cancelling():
                t.cancel()
    for t in tasks:
        if not t.done():
            t.cancel()
        with contextlib.suppress(BaseException):
            await t


@contextlib.contextmanager
def run_stack(
    valkey: EmbeddedServer,
    *,
    engines: list[Callable[[], Engine]] | None = None,
    tokenizer: EngineTokenizer | None = None,
    model: str = MODEL,
    worker_options: dict[str, Any] | None = None,
    broker_options: dict[str, Any] | None = None,
    keyring: KeyRing | None = None,
    broker_url: str | None = None,
    prefix: str | None = None,
    start_timeout_s: float = 60.0,
    **settings: Any,
) -> Iterator[Stack]:
    """Start the gateway and one worker per engine factory; stop everything on exit.
    Stacks given the same `prefix` share one broker namespace (several gateways).
    `start_timeout_s`: how long the engines' starts may take (a vLLM engine's holds the
    stack's loop for a minute or more on a busy CPU)."""
    prefix = prefix or f"gw{uuid.uuid4().hex[:10]}"
    broker_settings = BrokerSettings(
        url=broker_url or valkey.url, prefix=prefix, **(broker_options or {})
    )
    models = settings.pop("models", (model,))
    gw_settings = GatewaySettings(models=models, tokenizer="sim", **settings)
    sock = _free_socket()
    port = sock.getsockname()[1]
    ready = threading.Event()
    box: dict[str, Any] = {}
    errors: list[BaseException] = []

    async def main() -> None:
        gateway_broker = connect(broker_settings)
        app = create_app(
            gw_settings,
            gateway_broker,
            tokenizers={m: tokenizer or SimTokenizer() for m in models},
            keyring=keyring,
        )
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        stack = Stack(
            url=f"http://127.0.0.1:{port}",
            prefix=prefix,
            model=model,
            broker_settings=broker_settings,
            loop=asyncio.get_running_loop(),
            gateway_broker=gateway_broker,
            worker_options=worker_options or {},
        )
        for make in engines if engines is not None else [fast_engine]:
            await stack._start_worker(make())
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            if serving.done():
                await serving  # raises the startup error
            await asyncio.sleep(0.01)
        await _beaten(stack)
        box.update(server=server, stack=stack)
        ready.set()
        try:
            await serving
        finally:
            await stack._stop_workers()
            await gateway_broker.close()

    def thread_main() -> None:
        try:
            asyncio.run(main())
        except BaseException as exc:
            errors.append(exc)
        finally:
            ready.set()

    thread = threading.Thread(target=thread_main, name="gateway-stack", daemon=True)
    thread.start()
    ready.wait(start_timeout_s)
    if errors:
        raise errors[0]
    stack: Stack = box["stack"]
    try:
        yield stack
    finally:
        server: uvicorn.Server = box["server"]
        server.should_exit = True
        thread.join(30)
        sock.close()
        if errors:
            raise errors[0]


async def _beaten(stack: Stack) -> None:
    """Wait for every worker's first heartbeat (or its end): what a gateway admits before one
    is a worker's to judge, and a test asks what the gateway itself refuses."""
    while True:
        beating = {
            info.consumer
            for model in {worker.model for worker, _, _ in stack.workers}
            for info in await stack.gateway_broker.registry.workers(model)
        }
        if all(w.consumer in beating or task.done() for w, task, _ in stack.workers):
            return
        await asyncio.sleep(0.01)


@pytest.fixture
def stack(valkey: EmbeddedServer) -> Iterator[Stack]:
    """The default stack: one fast sim worker."""
    with run_stack(valkey) as s:
        yield s
