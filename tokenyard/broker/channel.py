"""The hot path's commands on connections of the broker's own.

Measured on the 2-core box (docs/benchmarks.md): a command through redis-py's client and
`BlockingConnectionPool` costs ~240 µs of CPU, the same command on a bare connection ~85 µs,
more than Valkey spends running a claim script. The difference is bookkeeping per command: a
task per send under a socket timeout, a pool condition, a shielded task per release. Scripts,
wake-ups and event reads (every request crosses them several times) go through a `Channel`;
everything else keeps the client.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

from hiredis import pack_command
from redis.asyncio import ConnectionPool
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ResponseError

Command = Sequence[str | bytes | int | float]


def pack(commands: Sequence[Command]) -> bytes:
    """Commands in RESP, as redis-py packs them (floats by repr), in one buffer: hiredis's C
    packer (redis[hiredis] is a dependency) takes a claim's ~90 arguments in a third of the
    time of Python's, which stays for what it refuses (a bool, a list instead of a tuple)."""
    try:
        return b"".join([pack_command(command) for command in commands])  # type: ignore[arg-type]
    except TypeError:
        return _pack_python(commands)


def _pack_python(commands: Sequence[Command]) -> bytes:
    out: list[bytes] = []
    for command in commands:
        out.append(b"*%d\r\n" % len(command))
        for arg in command:
            if isinstance(arg, str):
                data = arg.encode()
            elif isinstance(arg, bytes):
                data = arg
            elif isinstance(arg, float):
                data = repr(arg).encode()
            else:
                data = b"%d" % arg
            out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


class Channel:
    """Pipelined commands over a LIFO of idle connections, at most `limit` in use at once.

    One `asyncio.timeout` covers a whole exchange (so a dead peer cannot hang it); a connection
    whose exchange did not finish (error, timeout, cancellation) is closed, never reused, since
    replies may still be on their way to it.
    """

    def __init__(self, pool: ConnectionPool, limit: int, timeout_s: float) -> None:
        self._kwargs = {
            **pool.connection_kwargs,
            # the exchange's own timeout replaces redis-py's per-call wait_for tasks
            "socket_timeout": None,
            "health_check_interval": 0,
        }
        self._connection_class = pool.connection_class
        self._idle: list[AbstractConnection] = []
        self._slots = asyncio.Semaphore(max(1, limit))
        self.timeout_s = timeout_s

    async def execute(
        self, commands: Sequence[Command], timeout_s: float | None = None
    ) -> list[Any]:
        """Send `commands` in one write and read every reply; an error reply comes back as its
        exception, in its place (a pipeline's `raise_on_error=False`)."""
        async with self._slots:
            conn = self._idle.pop() if self._idle else self._connection_class(**self._kwargs)
            replies: list[Any] = []
            try:
                async with asyncio.timeout(timeout_s or self.timeout_s):
                    if not conn.is_connected:
                        await conn.connect()  # type: ignore[no-untyped-call]
                    await conn.send_packed_command([pack(commands)], check_health=False)
                    for _ in commands:
                        try:
                            replies.append(await conn.read_response())
                        except ResponseError as error:
                            replies.append(error)
            except BaseException:
                with contextlib.suppress(Exception):
                    await conn.disconnect(nowait=True)
                raise
            self._idle.append(conn)
            return replies

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            with contextlib.suppress(Exception):
                await conn.disconnect()
