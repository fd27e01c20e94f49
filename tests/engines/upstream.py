"""Real upstreams for the remote engine: a `tokenyard serve` process, and a TCP proxy that can
cut a connection mid-stream (to exercise retries against the real server behind it)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(url: str, proc: subprocess.Popen[bytes], path: str, timeout: float) -> None:
    give_up = time.monotonic() + timeout
    while time.monotonic() < give_up:
        if proc.poll() is not None:
            raise AssertionError(f"upstream exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{url} never became ready")


@contextlib.contextmanager
def process(cmd: list[str], url: str, path: str, timeout: float, **env: str) -> Iterator[str]:
    """Run a server process until the block ends; yield its base URL once `path` answers 200."""
    proc = subprocess.Popen(cmd, env={**os.environ, **env})
    try:
        wait_ready(url, proc, path, timeout)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def tokenyard_serve(data_dir: Path, engine: str = "hf", model: str = "tiny") -> Iterator[str]:
    """A whole tokenyard (Valkey, one worker, gateway) on a free port."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENYARD_")}
    cmd = [
        sys.executable, "-m", "tokenyard", "serve", "--engine", engine, "--model", model,
        "--port", str(port), "--max-seqs", "8", "--data-dir", str(data_dir),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, "/readyz", 180)
        yield url
    finally:
        proc.send_signal(signal.SIGINT)  # serve drains its workers before Valkey stops
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


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
