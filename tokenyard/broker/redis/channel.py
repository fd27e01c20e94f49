"""The hot path's commands on connections of the broker's own.

Measured on the 2-core box (docs/benchmarks.md): a command through redis-py's client and
`BlockingConnectionPool` costs ~240 µs of CPU, through a redis-py connection of its own ~170 µs,
through a bare asyncio protocol that hiredis parses ~105 µs; an `asyncio.timeout` per exchange
adds ~30 µs more. The backend's raw commands (scripts, wake-ups, event reads, polled reads: every
request crosses them several times) go through a `Channel` (connection.py); commands whose
replies redis-py parses (HGETALL, XRANGE, XINFO GROUPS) keep the client.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

import hiredis
from hiredis import pack_command
from redis.asyncio import ConnectionPool
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import (
    BusyLoadingError,
    InvalidResponse,
    NoScriptError,
    ReadOnlyError,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

Command = Sequence[str | bytes | int | float]

# How often a channel with exchanges in flight looks for one past its deadline: timeouts here are
# a dead peer's (a minute, or a blocking read's own wait plus that), so a tick this coarse is
# exact enough, and no exchange pays for a timer of its own.
WATCH_TICK_S = 0.5

# The error replies the broker tells apart, as redis-py classes them; any other is a
# ResponseError (`RedisConnection.results_of` reloads scripts on NOSCRIPT; LOADING, a server
# starting, is a connection error, so the broker answers unavailable).
_ERRORS: dict[str, type[Exception]] = {
    "NOSCRIPT": NoScriptError,
    "LOADING": BusyLoadingError,
    "READONLY": ReadOnlyError,
}
_MISSING = object()  # hiredis' answer while a reply is incomplete


def _reply_error(message: str) -> Exception:
    code, _, rest = message.partition(" ")
    kind = _ERRORS.get(code)
    return kind(rest) if kind is not None else ResponseError(message)


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


class _Wire(asyncio.Protocol):
    """One connection, one exchange at a time: a write, then replies parsed as they arrive.

    redis-py opens it (TLS, AUTH, SELECT, client name: all the URL asks for) and then hands its
    transport over: the replies skip redis-py's stream reader and parser layers.
    """

    def __init__(self, opened: AbstractConnection) -> None:
        writer = opened._writer  # redis-py's handshake is done: its transport becomes ours
        assert writer is not None
        self._opened = opened  # held: its stream objects close the transport when collected
        self.transport: asyncio.WriteTransport = writer.transport
        self._parser = hiredis.Reader(
            protocolError=InvalidResponse, replyError=_reply_error, notEnoughData=_MISSING
        )
        self._replies: list[Any] = []
        self._want = 0
        self._done: asyncio.Future[None] | None = None
        self.deadline = 0.0  # loop time the exchange in flight must end by
        self.broken = False
        self.loop = asyncio.get_running_loop()  # the only one its transport answers on
        self.transport.set_protocol(self)

    def data_received(self, data: bytes) -> None:
        self._parser.feed(data)
        done = self._done
        if done is None:
            self.fail(InvalidResponse("a reply arrived that no command asked for"))
            return
        replies, parser = self._replies, self._parser
        while len(replies) < self._want:
            reply = parser.gets()
            if reply is _MISSING:
                return
            replies.append(reply)
        self._done = None
        if not done.done():
            done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(RedisConnectionError(f"connection lost: {exc or 'closed by the server'}"))

    def fail(self, error: Exception) -> None:
        """End the exchange in flight with `error`; the connection is never used again."""
        self.broken = True
        with contextlib.suppress(RuntimeError):  # its event loop is closed: so is the socket
            self.transport.abort()
        done, self._done = self._done, None
        if done is not None and not done.done():
            done.set_exception(error)

    async def exchange(self, data: bytes, replies: int, deadline: float) -> list[Any]:
        self._replies = []
        self._want = replies
        self._done = done = asyncio.get_running_loop().create_future()
        self.deadline = deadline
        self.transport.write(data)
        await done
        got, self._replies = self._replies, []
        return got


class Channel:
    """Pipelined commands over a LIFO of idle connections, at most `limit` in use at once.

    Each exchange has a deadline (so a dead peer cannot hang it), kept by one watch per channel;
    a connection whose exchange did not finish (error, timeout, cancellation) is closed, never
    reused, since replies may still be on their way to it.
    """

    def __init__(self, pool: ConnectionPool, limit: int, timeout_s: float) -> None:
        self._kwargs = {
            **pool.connection_kwargs,
            # the channel keeps its own deadlines
            "socket_timeout": None,
            "health_check_interval": 0,
        }
        self._connection_class = pool.connection_class
        self._idle: list[_Wire] = []
        self._busy: set[_Wire] = set()
        self._slots = asyncio.Semaphore(max(1, limit))
        self._watch: asyncio.TimerHandle | None = None
        self._watching: asyncio.AbstractEventLoop | None = None
        self.timeout_s = timeout_s

    async def execute(
        self, commands: Sequence[Command], timeout_s: float | None = None
    ) -> list[Any]:
        """Send `commands` in one write and read every reply; an error reply comes back as its
        exception, in its place (a pipeline's `raise_on_error=False`)."""
        if not commands:
            return []
        data = pack(commands)
        loop = asyncio.get_running_loop()
        async with self._slots:
            wire = self._take_idle(loop) or await self._open()
            self._busy.add(wire)
            if self._watch is None or self._watching is not loop:
                # (a broker used from a second event loop: the first one's watch died with it)
                self._watching = loop
                self._watch = loop.call_later(WATCH_TICK_S, self._look)
            try:
                replies = await wire.exchange(
                    data, len(commands), loop.time() + (timeout_s or self.timeout_s)
                )
            except BaseException as exc:
                if not wire.broken:  # cancelled: its replies may still come
                    wire.fail(RedisConnectionError(f"exchange abandoned: {exc!r}"))
                raise
            finally:
                self._busy.discard(wire)
            self._idle.append(wire)
            return replies

    def _take_idle(self, loop: asyncio.AbstractEventLoop) -> _Wire | None:
        while self._idle:
            wire = self._idle.pop()
            # dropped here: an idle one the server closed, or one of an event loop gone by
            if not wire.broken and wire.loop is loop:
                return wire
            wire.fail(RedisConnectionError("dropped"))
        return None

    async def _open(self) -> _Wire:
        opened = self._connection_class(**self._kwargs)
        await opened.connect()  # type: ignore[no-untyped-call]
        return _Wire(opened)

    def _look(self) -> None:
        """Fail exchanges past their deadline; look again while any are in flight."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        for wire in list(self._busy):
            if now > wire.deadline:
                wire.fail(RedisTimeoutError("no reply within the channel's timeout"))
        self._watch = loop.call_later(WATCH_TICK_S, self._look) if self._busy else None

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        idle, self._idle = self._idle, []
        for wire in idle:
            with contextlib.suppress(Exception):
                wire.transport.close()
