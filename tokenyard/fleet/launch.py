"""Local processes of a tokenyard stack, one copy for `serve`, the tests and the benchmarks: a
free port, a wait until a URL answers, named child processes, and gateways and workers on one
broker. Every child is spawned through tokenyard.children, so it dies with its parent."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import httpx
import uvicorn
from starlette.types import ASGIApp

# free_port is re-exported: the tests and benchmarks take it from here with the rest
from tokenyard.children import free_port as free_port
from tokenyard.children import spawn_tied

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


def tokenyard_command(*args: str) -> list[str]:
    """`python -m tokenyard ARGS` under this interpreter."""
    return [sys.executable, "-m", "tokenyard", *args]


def stop_processes(
    procs: Iterable[subprocess.Popen[bytes]], timeout_s: float, sig: int = signal.SIGTERM
) -> None:
    """Send `sig` to every live process (its whole group where it leads one), wait up to
    `timeout_s` for each, and SIGKILL what lingers."""
    procs = list(procs)
    for proc in procs:
        _send(proc, sig)
    for proc in procs:
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("process %d did not stop in %g s; killing it", proc.pid, timeout_s)
            _send(proc, signal.SIGKILL)
            proc.wait()


def _send(proc: subprocess.Popen[bytes], sig: int) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        # a child in its own session may have forked workers of its own (Celery, vLLM)
        if os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)


class Processes:
    """Named child processes, each logging to `log_dir/NAME.log` (to this process's output
    when there is no log_dir); stopped together, by a signal and then SIGKILL."""

    def __init__(
        self, log_dir: Path | None = None, on_parent_death: signal.Signals = signal.SIGTERM
    ) -> None:
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir = log_dir
        self.on_parent_death = on_parent_death
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        new_session: bool = False,
        **popen: Any,
    ) -> subprocess.Popen[bytes]:
        """Start `argv` as `name` (a taken name gets a number); `env` is the whole environment
        (None: this process's); further keywords go to Popen, e.g. stderr=PIPE."""
        unique, n = name, 1
        while unique in self.procs:
            n += 1
            unique = f"{name}-{n}"
        options: dict[str, Any] = {"stdin": subprocess.DEVNULL}
        with contextlib.ExitStack() as files:
            if self.log_dir is not None:
                log_file = files.enter_context((self.log_dir / f"{unique}.log").open("wb"))
                options.update(stdout=log_file, stderr=subprocess.STDOUT)
            options.update(popen)
            proc = spawn_tied(
                argv,
                self.on_parent_death,
                env=None if env is None else dict(env),
                cwd=cwd,
                start_new_session=new_session,
                **options,
            )
        self.procs[unique] = proc
        return proc

    def pids(self) -> dict[str, int]:
        return {name: proc.pid for name, proc in self.procs.items()}

    def log_tail(self, which: str | subprocess.Popen[bytes], chars: int = 3000) -> str:
        """The end of a process's log, by name or by process ('' without a log)."""
        name = which if isinstance(which, str) else self._name_of(which)
        if self.log_dir is None or name is None:
            return ""
        try:
            return (self.log_dir / f"{name}.log").read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def _name_of(self, proc: subprocess.Popen[bytes]) -> str | None:
        return next((name for name, p in self.procs.items() if p is proc), None)

    def check(self) -> None:
        """Raise if any process has exited, with the end of its log."""
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.log_tail(name)}")

    def send_signal(self, sig: int = signal.SIGTERM) -> None:
        """Send `sig` to every live process, without waiting (stops several stacks at once)."""
        for proc in self.procs.values():
            _send(proc, sig)

    def stop(self, timeout_s: float = 20.0, sig: int = signal.SIGTERM) -> None:
        """`sig` to every live process (SIGTERM: workers drain), then SIGKILL what lingers."""
        stop_processes(self.procs.values(), timeout_s, sig)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def wait_ready(
    url: str,
    watch: Processes | subprocess.Popen[bytes] | None = None,
    *,
    timeout_s: float = 60.0,
    interval_s: float = 0.1,
) -> None:
    """Poll GET `url` until it answers 200. Raise RuntimeError if a watched process exits
    first, TimeoutError after `timeout_s`. From async code: `await asyncio.to_thread(...)`."""
    give_up = time.monotonic() + timeout_s
    with httpx.Client(timeout=5.0) as client:
        while True:
            if isinstance(watch, Processes):
                watch.check()
            elif watch is not None and watch.poll() is not None:
                raise RuntimeError(f"{watch.args!r} exited with {watch.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if client.get(url).status_code == 200:
                    return
            if time.monotonic() > give_up:
                raise TimeoutError(f"{url} did not answer 200 within {timeout_s:g} s")
            time.sleep(interval_s)


@dataclass
class Launcher:
    """Starts `tokenyard gateway` and `tokenyard worker` processes on one broker and key
    prefix, into `processes`."""

    processes: Processes
    broker_url: str
    prefix: str
    tables_url: str = ""  # amqp:// lanes: their tables' Redis URL

    @property
    def broker_args(self) -> list[str]:
        tables = ["--tables", self.tables_url] if self.tables_url else []
        return ["--broker", self.broker_url, "--prefix", self.prefix, *tables]

    def gateway(
        self,
        port: int,
        *args: str,
        name: str = "gateway",
        env: Mapping[str, str] | None = None,
        **popen: Any,
    ) -> subprocess.Popen[bytes]:
        """Start a gateway on `port`, not waiting for it: `wait_ready` on its /healthz, or on
        /readyz where a live worker must be up too."""
        argv = tokenyard_command("gateway", *self.broker_args, *args, "--port", str(port))
        return self.processes.start(name, argv, env=env, **popen)

    def worker(
        self,
        *args: str,
        name: str = "worker",
        env: Mapping[str, str] | None = None,
        **popen: Any,
    ) -> subprocess.Popen[bytes]:
        return self.processes.start(
            name, tokenyard_command("worker", *self.broker_args, *args), env=env, **popen
        )


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
        yield f"http://{LOOPBACK}:{port}"
    finally:
        server.should_exit = True
        await task
