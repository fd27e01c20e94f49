"""Which broker URLs are taken, and the one line that refuses the rest."""

from __future__ import annotations

import pytest

from tokenyard.broker import NO_BROKER, check_url
from tokenyard.errors import FatalError


@pytest.mark.parametrize(
    "url",
    [
        "redis://localhost:6379/0",
        "rediss://queue:6380/1",
        "unix:///run/valkey.sock?db=0",
        "redis+cluster://node:6379",
        "nats://localhost:4222",
        "nats://a:4222,b:4222?replicas=3",
        "tls://nats.example:4222",
    ],
)
def test_every_backend_scheme_is_taken(url: str) -> None:
    check_url(url)


def test_another_scheme_is_refused_naming_the_ones_taken() -> None:
    with pytest.raises(FatalError) as refused:
        check_url("mqtt://broker:1883")
    line = str(refused.value)
    assert "\n" not in line and "'mqtt://broker:1883'" in line
    taken = ("redis://", "rediss://", "unix://", "redis+cluster://", "nats://", "tls://", "amqp://")
    for scheme in (*taken, "amqps://"):
        assert scheme in line


def test_no_url_says_how_to_name_one() -> None:
    with pytest.raises(FatalError, match="--broker"):
        check_url("")
    assert "nats://" in NO_BROKER
