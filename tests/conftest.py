"""Shared fixtures: private servers for the session, and backends of every kind over them.

`make_backend` is parametrized over backend kinds: each kind names the session fixture that
starts its server. A backend added later (RabbitMQ lanes) is one more entry in `BACKENDS` with
a session fixture for its server, a URL scheme in `SCHEMES` and what the harness can do to its
server in `HARNESS`. Tests pick kinds with `kinds(...)` by what they need (the backend's
declared traits, the harness's abilities), never by name.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from _pytest.mark.structures import ParameterSet

from tests.servers import Can, Cluster, RabbitServer, Tansu, running_cluster, running_server
from tokenyard.broker import AMQP_SCHEMES, Backend, connect, traits_of
from tokenyard.broker.core import Clock, Trait
from tokenyard.broker.nats.embedded import EmbeddedNats
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.config import BrokerSettings

# backend kind -> the session fixture whose `.url` reaches its server
BACKENDS = {
    "valkey": "valkey",
    "valkey-cluster": "valkey_cluster",
    "nats": "nats_server",
    "rabbitmq": "rabbitmq",
}
# how each kind's URL starts: what its backend declares (core.Trait) is read from it
SCHEMES = {
    "valkey": "redis://",
    "valkey-cluster": "redis+cluster://",
    "nats": "nats://",
    "rabbitmq": "amqp://",
}
TRAITS = {kind: traits_of(scheme) for kind, scheme in SCHEMES.items()}
# what the fault harness can do to each kind's server (tests/servers.py), and why not the rest
HARNESS: dict[str, dict[Can, str | None]] = {
    "valkey": {Can.RESTART: None, Can.PARTITION: None},
    "valkey-cluster": {
        # one node of three, the one holding the test's model (its keys share one slot)
        Can.RESTART: None,
        Can.PARTITION: "a cluster client follows the node addresses the cluster announces, "
        "around any relay",
    },
    "nats": {Can.RESTART: None, Can.PARTITION: None},
    # the lanes' server and the tables' Valkey, each through a relay of its own
    "rabbitmq": {Can.RESTART: None, Can.PARTITION: None},
}
# the kinds on the Redis backend: tests of its internals (keys, script cache) run only there
REDIS_KINDS = frozenset({"valkey", "valkey-cluster"})


def kinds(*needs: Trait | Can, among: Sequence[str] = tuple(BACKENDS)) -> list[ParameterSet]:
    """Every kind of `among` as a parameter (of `make_backend`, or a fixture that takes a
    kind); one whose backend lacks a trait of `needs`, or whose server the harness cannot do
    a `Can` of `needs` to, is skipped with why."""
    params = []
    for kind in among:
        why = []
        for need in needs:
            if isinstance(need, Trait) and need not in TRAITS[kind]:
                declared = ", ".join(sorted(TRAITS[kind])) or "none"
                why.append(f"its backend does not declare {need} (it declares: {declared})")
            elif isinstance(need, Can) and HARNESS[kind].get(need, "not built") is not None:
                why.append(f"the harness cannot {need} its server: {HARNESS[kind].get(need)}")
        marks = [pytest.mark.skip(reason=f"{kind}: " + "; ".join(why))] if why else []
        params.append(pytest.param(kind, marks=marks, id=kind))
    return params


# what `make_backend` runs on unless a module asks for more (a cluster costs three servers):
# pytestmark = pytest.mark.parametrize("make_backend", list(BACKENDS), indirect=True)
DEFAULT_BACKENDS = ["valkey"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark what needs RabbitMQ or a Kafka broker (`make test-brokers` runs it; `make test`
    leaves it out). Under pytest-xdist (`--dist loadgroup`) a file's tests stay together (its
    module fixtures start once) and the fault tests, which kill real processes against time
    budgets, run one after another in one worker."""
    for item in items:
        group = "faults" if item.get_closest_marker("fault") else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))
        if "tansu" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.kafka)
        params = getattr(item, "callspec", None)
        values = params.params.values() if params is not None else ()
        if any(v == "rabbitmq" for v in values) or "rabbitmq" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.rabbitmq)


@pytest.fixture
def root_logging() -> Iterator[None]:
    """The root logger's handlers and level back as they were, for a test that runs a command's
    `setup_logging` in this process (its handler writes to a stream the test's capture closes)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    logger_class = logging.getLoggerClass()
    # setup_logging turns off finding a record's source, thread and process names
    switches = logging._srcfile, logging.logThreads, logging.logMultiprocessing
    yield
    logging._srcfile, logging.logThreads, logging.logMultiprocessing = switches
    root.handlers[:] = handlers
    root.setLevel(level)
    logging.setLoggerClass(logger_class)  # setup_logging adopts libraries' loggers made later
    logging.captureWarnings(False)


@pytest.fixture(scope="session")
def valkey() -> Iterator[EmbeddedServer]:
    with running_server() as server:
        yield server


@pytest.fixture(scope="session")
def valkey_cluster() -> Iterator[Cluster]:
    """Three primaries sharing the slots; started only by tests that ask for it."""
    with running_cluster(3) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    """One nats-server with JetStream; tests keep apart by their own name prefix."""
    with EmbeddedNats(tmp_path_factory.mktemp("nats")) as server:
        yield server


@pytest.fixture(scope="session")
def rabbitmq() -> Iterator[RabbitServer]:
    """One RabbitMQ node (Debian's rabbitmq-server, 15-20 s to start) in a temp dir of its own,
    removed after; tests keep apart by their own queue names."""
    with RabbitServer() as server:
        yield server


@pytest.fixture(scope="session")
def tansu(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tansu]:
    """One Tansu broker (the Kafka protocol) for the Kafka audit log; tests keep apart by
    topic."""
    with Tansu(tmp_path_factory.mktemp("tansu") / "tansu.log") as server:
        yield server


@dataclass
class BackendFactory:
    """Opens backends of one kind on its server, under a key prefix of the test's own: two
    opened in one test are two clients of the same broker."""

    kind: str
    url: str
    tables_url: str = ""  # RabbitMQ lanes' tables (a Valkey)
    prefix: str = field(default_factory=lambda: f"t{uuid.uuid4().hex[:10]}")
    made: list[Backend] = field(default_factory=list)

    @property
    def traits(self) -> frozenset[Trait]:
        """What the kind's backend declares (core.Trait): what a test may hold it to."""
        return traits_of(self.url)

    def __call__(self, clock: Clock = time.time, **overrides: Any) -> Backend:
        settings = BrokerSettings(
            url=self.url, tables_url=self.tables_url, prefix=self.prefix, **overrides
        )
        backend = connect(settings, clock=clock)
        self.made.append(backend)
        return backend


def session_urls(request: pytest.FixtureRequest, kind: str) -> tuple[str, str]:
    """The broker URL of the session's server of `kind`, and its tables' URL: RabbitMQ lanes
    keep their tables on the session's Valkey ("" for the others)."""
    url = request.getfixturevalue(BACKENDS[kind]).url
    return url, request.getfixturevalue("valkey").url if url.startswith(AMQP_SCHEMES) else ""


@pytest.fixture(params=DEFAULT_BACKENDS)
async def make_backend(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[BackendFactory]:
    """Build backends of the param's kind with settings overrides (and a clock); closed after.
    Tables kept apart (RabbitMQ lanes') are named in the environment too, so the processes a
    test starts (workers, gateways, consumers) find them."""
    url, tables = session_urls(request, request.param)
    if tables:
        monkeypatch.setenv("TOKENYARD_BROKER_TABLES_URL", tables)
    factory = BackendFactory(request.param, url, tables)
    yield factory
    for backend in factory.made:
        await backend.close()
