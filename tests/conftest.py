"""Shared fixtures: a private Valkey server for the session and brokers of every kind."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Iterator

import pytest

from tests.servers import Cluster, running_cluster, running_server
from tokenyard.broker import Backend, _whole, connect
from tokenyard.broker.memory import MemoryBroker
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.config import BrokerSettings

BrokerFactory = Callable[..., Backend]


@pytest.fixture(scope="session")
def valkey() -> Iterator[EmbeddedServer]:
    with running_server() as server:
        yield server


@pytest.fixture(scope="session")
def valkey_cluster() -> Iterator[Cluster]:
    """Three primaries sharing the slots; started only by tests that ask for it."""
    with running_cluster(3) as cluster:
        yield cluster


# "cluster" is opt-in per test (parametrize make_broker indirectly), it costs three servers
@pytest.fixture(params=["memory", "redis"])
async def make_broker(
    request: pytest.FixtureRequest, valkey: EmbeddedServer
) -> AsyncIterator[BrokerFactory]:
    """Build brokers with settings overrides; each test gets its own key prefix."""
    made: list[Backend] = []
    prefix = f"t{uuid.uuid4().hex[:10]}"
    memory_shared: dict[str, MemoryBroker] = {}

    def factory(**overrides: object) -> Backend:
        if request.param == "memory":
            # one in-process store per test, as several clients of one Redis would share it
            base = memory_shared.get("store")
            settings = BrokerSettings(url="memory://", prefix=prefix, **overrides)  # type: ignore[arg-type]
            memory = MemoryBroker(settings, store=base.store if base else None)
            memory_shared.setdefault("store", memory)
            broker = _whole(memory)
        else:
            url = valkey.url
            if request.param == "cluster":
                url = request.getfixturevalue("valkey_cluster").url
            settings = BrokerSettings(url=url, prefix=prefix, **overrides)  # type: ignore[arg-type]
            broker = connect(settings)
        made.append(broker)
        return broker

    factory.kind = request.param  # type: ignore[attr-defined]
    yield factory
    for broker in made:
        await broker.close()
