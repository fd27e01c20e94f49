"""The harness the benchmark scripts share: ports, CPU time, percentiles, server facts and the
subprocesses (gateway, worker, consumer) a benchmark starts and stops."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import redis
import uvicorn
from starlette.types import ASGIApp

from tokenyard.bench.stats import percentile as _percentile

REPO = Path(__file__).resolve().parents[1]

# Benchmarks measure the serving path: their gateways (in this process, or subprocesses that
# inherit this environment) answer nothing from the response cache and collapse nothing,
# however often a workload repeats a greedy request. bench/cache_collapse.py turns them on.
os.environ.setdefault("TOKENYARD_GATEWAY_CACHE", "false")
os.environ.setdefault("TOKENYARD_GATEWAY_COLLAPSE", "false")


def free_port() -> int:
    """A loopback TCP port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def proc_cpu_s(pid: int | None) -> float:
    """utime + stime of a process from /proc (0.0 where unavailable)."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100), as numpy's default; None for no values."""
    return _percentile(values, q) if values else None


def loadavg() -> list[float]:
    """1, 5 and 15 minute load averages: how busy the machine was around a measurement."""
    return [round(x, 2) for x in os.getloadavg()]


def server_version(client: redis.Redis) -> str:
    """`valkey 8.1.1` or `redis 7.2.4`."""
    info: dict[str, Any] = client.info("server")
    if "valkey_version" in info:
        return f"valkey {info['valkey_version']}"
    return f"redis {info['redis_version']}"


def command_calls(client: redis.Redis) -> dict[str, int]:
    """INFO commandstats as {command: calls}; commands run inside scripts count too."""
    stats: dict[str, dict[str, Any]] = client.info("commandstats")
    return {key.removeprefix("cmdstat_"): int(row["calls"]) for key, row in stats.items()}


def _leads_group(proc: subprocess.Popen[bytes]) -> bool:
    return os.getpgid(proc.pid) == proc.pid


class Processes:
    """Named subprocesses of one benchmark stack, each logging to a file; SIGTERM stops them
    (workers drain), SIGKILL what lingers."""

    def __init__(self, log_dir: Path) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(
        self, name: str, cmd: list[str], cwd: Path = REPO, new_session: bool = False
    ) -> subprocess.Popen[bytes]:
        with (self.log_dir / f"{name}.log").open("wb") as log:
            proc = subprocess.Popen(
                cmd,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=new_session,
            )
        self.procs[name] = proc
        return proc

    def pids(self) -> dict[str, int]:
        return {name: proc.pid for name, proc in self.procs.items()}

    def log_tail(self, name: str, chars: int = 3000) -> str:
        try:
            return (self.log_dir / f"{name}.log").read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def check(self) -> None:
        """Raise if any process has exited, with the end of its log."""
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.log_tail(name)}")

    def signal(self) -> None:
        """SIGTERM every live process (its whole group when it has its own session)."""
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    if _leads_group(proc):
                        os.killpg(proc.pid, signal.SIGTERM)
                    else:
                        proc.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 20.0) -> None:
        self.signal()
        for proc in self.procs.values():
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL) if _leads_group(proc) else proc.kill()
                proc.wait()


async def wait_ready(base: str, procs: Processes, timeout_s: float = 60.0) -> None:
    """Poll /readyz until the gateway answers and sees a live worker."""
    give_up = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=base, timeout=5.0) as client:
        while True:
            procs.check()
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get("/readyz")).status_code == 200:
                    return
            if time.monotonic() > give_up:
                raise TimeoutError(f"{base} did not become ready")
            await asyncio.sleep(0.1)


@contextlib.asynccontextmanager
async def serving(app: ASGIApp, port: int) -> AsyncIterator[str]:
    """Serve an ASGI app over real HTTP from this event loop; yields its base URL."""
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            await task  # raises the startup error
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task
