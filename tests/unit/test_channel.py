"""The channel's RESP packer writes exactly what redis-py's does."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from redis.asyncio.connection import Connection

from tokenyard.broker.redis.channel import Command, pack

_args = st.one_of(
    st.text(max_size=20),
    st.binary(max_size=20),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
)


# the name comes first (redis-py splits a multi-word name; the broker's names are one word)
_command = st.tuples(st.sampled_from(["EVALSHA", "XREAD", "SADD"]), st.lists(_args, max_size=12))


@given(st.lists(_command, min_size=1, max_size=5))
def test_pack_matches_redis_py(
    commands: list[tuple[str, list[str | bytes | int | float]]],
) -> None:
    as_commands: list[Command] = [(name, *args) for name, args in commands]
    assert pack(as_commands) == b"".join(Connection().pack_commands(as_commands))
