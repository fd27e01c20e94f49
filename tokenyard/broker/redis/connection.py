"""The Redis backend's one connection layer: the client (plain or cluster), the channel, scripts
by SHA, and the one place where connection trouble becomes `BrokerUnavailable` (HTTP 503).

The queue and every table send through it: raw commands on the channel (`pipelined`, `checked`,
`one`), scripts (`run`, `eval_many`, `results_of`), replies parsed by redis-py (`parsed`), and
redis-py pipelines where its reply parsing is what a caller wants (`pipeline` + `execute`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any, TypeVar, cast

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.exceptions import ClusterDownError, NoScriptError, SlotNotCoveredError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tokenyard.broker.redis import scripts
from tokenyard.broker.redis.channel import Channel, Command
from tokenyard.broker.redis.scripts import Call
from tokenyard.config import BrokerSettings
from tokenyard.errors import BrokerUnavailable

SOCKET_TIMEOUT_S = 60.0
MAX_BLOCK_S = 30.0  # callers' block_s is capped so a blocking read never meets the read timeout
CLUSTER_SCHEME = "redis+cluster://"

# what "the server cannot be reached" looks like from redis-py and the channel (a server still
# loading its data answers LOADING, which both class as a ConnectionError); on a cluster, a node
# down or a slot moving (CLUSTERDOWN, TRYAGAIN, a slot no node serves yet) once redis-py's own
# retries are spent: all pass, so a caller keeps its writes to send again rather than drop them
_TROUBLE = (
    RedisConnectionError,
    RedisTimeoutError,
    ClusterDownError,
    TryAgainError,
    SlotNotCoveredError,
    OSError,
)
_T = TypeVar("_T")


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


def xread_command(cursors: Mapping[str, str], count: int, block_s: float | None) -> Command:
    block: list[str | int] = [] if block_s is None else ["BLOCK", ms(block_s)]
    return ("XREAD", "COUNT", count, *block, "STREAMS", *cursors, *cursors.values())


def _unavailable(exc: BaseException) -> BrokerUnavailable:
    return BrokerUnavailable(str(exc) or type(exc).__name__)


async def _sent(exchange: Awaitable[_T]) -> _T:
    """Every exchange with the server is awaited here: connection trouble comes out as
    BrokerUnavailable, never a redis-py error."""
    try:
        return await exchange
    except _TROUBLE as exc:
        raise _unavailable(exc) from exc


def _client(settings: BrokerSettings) -> aioredis.Redis:
    """A client for `settings.url`; `redis+cluster://host:port` (any node) is a Redis Cluster."""
    if settings.url.startswith(CLUSTER_SCHEME):
        from redis.asyncio.cluster import RedisCluster

        cluster = RedisCluster.from_url(
            "redis://" + settings.url.removeprefix(CLUSTER_SCHEME),
            max_connections=settings.max_connections,
            decode_responses=False,
            socket_timeout=SOCKET_TIMEOUT_S,
            socket_connect_timeout=5,
        )
        # every script's keys share one slot and cross-slot work is split per model, so the
        # backend uses only commands both clients route the same way
        return cast(aioredis.Redis, cluster)
    # callers past max_connections wait for a free connection rather than fail
    pool = aioredis.BlockingConnectionPool.from_url(
        settings.url,
        max_connections=settings.max_connections,
        timeout=SOCKET_TIMEOUT_S,
        decode_responses=False,
        health_check_interval=30,
        # blocking reads wait up to several seconds server-side; redis-py's 5 s default
        # read timeout would cut them off under load
        socket_timeout=SOCKET_TIMEOUT_S,
        socket_connect_timeout=5,
    )
    return aioredis.Redis(connection_pool=pool)


class RedisConnection:
    """Every command the backend sends, whichever role sends it."""

    def __init__(
        self,
        settings: BrokerSettings,
        client: aioredis.Redis | None = None,
        extra_scripts: Sequence[scripts.ScriptSpec[Any, Any, Any, Any]] = (),
    ) -> None:
        """`extra_scripts`: another backend's scripts on this server (RabbitMQ lanes' tables)."""
        self.client: aioredis.Redis = client or _client(settings)
        # a cluster client routes each command by slot itself: it keeps every call
        pool = getattr(self.client, "connection_pool", None)
        self.channel = (
            Channel(pool, settings.max_connections, SOCKET_TIMEOUT_S)
            if isinstance(pool, aioredis.ConnectionPool)
            else None
        )
        self._sources = {spec.id: spec.source() for spec in (*scripts.SCRIPTS, *extra_scripts)}
        self._shas = {
            name: hashlib.sha1(src.encode()).hexdigest() for name, src in self._sources.items()
        }

    # -- raw commands ----------------------------------------------------------------------
    async def pipelined(self, commands: Sequence[Command], timeout_s: float = 0.0) -> list[Any]:
        """Raw commands in one round trip, error replies in their places; on the channel
        unless this is a cluster client."""
        if self.channel is not None:
            replies = await _sent(self.channel.execute(commands, timeout_s or None))
        else:
            pipe = self.client.pipeline(transaction=False)
            for command in commands:
                pipe.execute_command(*command)
            replies = await _sent(pipe.execute(raise_on_error=False))
        for i, reply in enumerate(replies):
            if isinstance(reply, _TROUBLE):  # LOADING: a server starting is not reachable yet
                replies[i] = _unavailable(reply)
        return replies

    async def checked(self, commands: Sequence[Command], timeout_s: float = 0.0) -> list[Any]:
        """`pipelined`, raising the first error reply (the gateway's polled reads and the
        worker's heartbeat are frequent enough that redis-py's per-command cost shows)."""
        replies = await self.pipelined(commands, timeout_s)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies

    async def one(self, command: Command) -> Any:
        (reply,) = await self.checked([command])
        return reply

    # -- redis-py's parsing ----------------------------------------------------------------
    async def parsed(self, *command: str | bytes | int | float) -> Any:
        """One command through the client, its reply parsed as redis-py parses it (HGETALL a
        dict, XRANGE (id, fields) pairs, SMEMBERS a set)."""
        return await _sent(self.client.execute_command(*command))  # type: ignore[no-untyped-call]

    def pipeline(self) -> Pipeline:
        """A redis-py pipeline to fill, then `execute`: for replies it parses (XINFO GROUPS)."""
        return self.client.pipeline(transaction=False)

    async def execute(self, pipe: Pipeline, raise_on_error: bool = True) -> list[Any]:
        replies: list[Any] = await _sent(pipe.execute(raise_on_error=raise_on_error))
        return replies

    # -- scripts ---------------------------------------------------------------------------
    def evalsha(self, call: Call) -> Command:
        # plain EVALSHA: redis-py's Script objects send SCRIPT EXISTS before every pipeline;
        # as a raw command, as a cluster pipeline refuses .evalsha() (it routes the raw one by
        # its first key, and all of a script's keys share that slot)
        name, keys, args = call
        return ("EVALSHA", self._shas[name], len(keys), *keys, *args)

    async def run(self, call: Call) -> Any:
        return (await self.eval_many([call]))[0]

    async def eval_many(self, calls: Sequence[Call]) -> list[Any]:
        """Run scripts by SHA in one round trip; any the server lacks (it restarted) are loaded
        and only those calls run again, so nothing runs twice."""
        replies = await self.pipelined([self.evalsha(call) for call in calls])
        return await self.results_of(calls, replies)

    async def eval_with(
        self, calls: Sequence[Call], commands: Sequence[Command]
    ) -> tuple[list[Any], list[Any]]:
        """Scripts and other commands in one round trip: the scripts' results (as `eval_many`)
        and the other commands' replies, errors in their places."""
        replies = await self.pipelined([self.evalsha(call) for call in calls] + list(commands))
        return await self.results_of(calls, replies[: len(calls)]), replies[len(calls) :]

    async def results_of(self, calls: Sequence[Call], replies: list[Any]) -> list[Any]:
        """The scripts' results from their replies: those the server lacked (NOSCRIPT) are
        loaded and run again; the first error reply raises."""
        missing = [i for i, r in enumerate(replies) if isinstance(r, NoScriptError)]
        if missing:
            for name in {calls[i][0] for i in missing}:
                # through the client: a cluster client loads it on every primary
                await _sent(self.client.script_load(self._sources[name]))
            again = await self.pipelined([self.evalsha(calls[i]) for i in missing])
            for i, result in zip(missing, again, strict=True):
                replies[i] = result
        for result in replies:
            if isinstance(result, Exception):
                raise result
        return replies

    # -- lifetime --------------------------------------------------------------------------
    async def ping(self) -> bool:
        try:
            return bool(await self.client.ping())
        except _TROUBLE:
            return False

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()
        await self.client.aclose()
