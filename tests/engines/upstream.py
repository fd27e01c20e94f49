"""Real upstreams for the remote engine: a `tokenyard serve` process, and a TCP proxy that can
cut a connection mid-stream (to exercise retries against the real server behind it)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

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
def tokenyard_serve(data_dir: Path, engine: str = "hf", model: str = "tiny") -> Iterator[str]:
    """A whole tokenyard (Valkey, one worker, gateway) on a free port."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENYARD_")}
    cmd = tokenyard_command(
        "serve", "--engine", engine, "--model", model,
        "--port", str(port), "--max-seqs", "8", "--data-dir", str(data_dir),
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
