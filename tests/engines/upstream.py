"""Upstreams for the remote engine: a `tokenyard serve` process, a TCP proxy that can cut a
connection mid-stream (to exercise retries against the real server behind it), and a scripted
one that records what the engine sends (its request bodies) and answers as told."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from tokenyard.fleet.launch import Processes, free_port, tokenyard_command, wait_ready


@contextlib.contextmanager
def process(cmd: list[str], url: str, path: str, timeout: float, **env: str) -> Iterator[str]:
    """Run a server process until the block ends; yield its base URL once `path` answers 200."""
    procs = Processes()
    procs.start("upstream", cmd, env={**os.environ, **env})
    try:
        wait_ready(url + path, procs, timeout_s=timeout, interval_s=0.5)
        yield url
    finally:
        procs.stop(timeout_s=60)


@contextlib.contextmanager
def tokenyard_serve(
    data_dir: Path, engine: str = "hf", model: str = "tiny", *extra: str
) -> Iterator[str]:
    """A whole tokenyard (Valkey, one worker, gateway) on a free port; `extra`: more flags."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENYARD_")}
    cmd = tokenyard_command(
        "serve", "--engine", engine, "--model", model,
        "--port", str(port), "--max-seqs", "8", "--data-dir", str(data_dir), *extra,
    )  # fmt: skip
    procs = Processes()
    procs.start("serve", cmd, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url + "/readyz", procs, timeout_s=180, interval_s=0.5)
        yield url
    finally:
        procs.stop(timeout_s=90, sig=signal.SIGINT)  # serve drains its workers before Valkey stops


class CuttingProxy:
    """Forwards TCP to `target`; the first `cuts` connections are closed after `after` bytes."""

    def __init__(self, target_port: int, *, cuts: int, after: int) -> None:
        self.target_port = target_port
        self.cuts = cuts
        self.after = after
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        limit = self.after if self.connections <= self.cuts else None
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def pipe(
            src: asyncio.StreamReader, dst: asyncio.StreamWriter, cap: int | None
        ) -> None:
            sent = 0
            with contextlib.suppress(OSError):
                while data := await src.read(4096):
                    if cap is not None and sent + len(data) > cap:
                        dst.write(data[: cap - sent])
                        break
                    dst.write(data)
                    sent += len(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer, None), pipe(up_reader, writer, limit))


Respond = Callable[[dict[str, Any]], Iterable[dict[str, Any]]]


class ScriptedUpstream:
    """A `/v1/completions` upstream that records each request's JSON body and streams the
    chunks `respond(body)` makes (each a `choices[0]` payload) as SSE; `cut_after`: the first
    connection is closed after that many chunks, without a finish; `one_write`: every chunk in
    one write (an upstream that answers at once, or one under load: its reader gets several
    events in one read)."""

    def __init__(
        self, respond: Respond, *, cut_after: int | None = None, one_write: bool = False
    ) -> None:
        self.respond = respond
        self.cut_after = cut_after
        self.one_write = one_write
        self.bodies: list[dict[str, Any]] = []
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.decode().split("\r\n"):
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            body = json.loads(await reader.readexactly(length))
            self.bodies.append(body)
            cut = self.cut_after if len(self.bodies) == 1 else None
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
            )
            held: list[bytes] = []
            for i, choice in enumerate(self.respond(body)):
                if cut is not None and i == cut:
                    break
                chunk = {"id": "x", "object": "text_completion", "choices": [choice]}
                held.append(f"data: {json.dumps(chunk)}\n\n".encode())
                if not self.one_write:
                    writer.write(held.pop())
                    await writer.drain()
            else:
                held.append(b"data: [DONE]\n\n")
            writer.write(b"".join(held))
            await writer.drain()
        writer.close()
