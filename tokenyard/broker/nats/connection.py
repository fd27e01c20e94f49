"""The NATS backend's one connection: a nats-py client opened on first use, JetStream, the
streams and KV buckets it has made sure of, and the one place where connection trouble
becomes `BrokerUnavailable` (HTTP 503).

`connect()` is synchronous while nats-py connects asynchronously, so the client is opened by
the first call that needs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlsplit

import msgspec
import nats
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StreamConfig
from nats.js.kv import KeyValue

from tokenyard.broker.nats.client import Client, Outgoing
from tokenyard.config import BrokerSettings
from tokenyard.errors import BrokerUnavailable, FatalError

log = logging.getLogger(__name__)

SCHEMES = ("nats://", "tls://")
REQUEST_TIMEOUT_S = 5.0

# what "the server cannot be reached (or has no JetStream just now)" looks like from nats-py
_TROUBLE: tuple[type[BaseException], ...] = (
    nats.errors.ConnectionClosedError,
    nats.errors.NoServersError,
    nats.errors.NoRespondersError,
    nats.errors.TimeoutError,
    nats.errors.StaleConnectionError,
    nats.errors.OutboundBufferLimitError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.ConnectionDrainingError,
    nats.js.errors.ServiceUnavailableError,
    # a publish no stream leader answered: in a cluster, while a dead node's streams elect
    nats.js.errors.NoStreamResponseError,
    asyncio.TimeoutError,
    OSError,
)
_T = TypeVar("_T")


@dataclass(frozen=True)
class Endpoint:
    """What a nats:// URL names: the servers, and how many replicas streams get."""

    servers: list[str]
    replicas: int = 1


def parse_url(url: str) -> Endpoint:
    """`nats://host:port[,host:port...][?replicas=N]` (tls:// too)."""
    scheme, _, rest = url.partition("://")
    if f"{scheme}://" not in SCHEMES or not rest:
        raise FatalError(f"broker URL {url!r}: expected nats://host:port[,host:port][?replicas=N]")
    hosts, _, query = rest.partition("?")
    servers = [f"{scheme}://{h}" for h in hosts.rstrip("/").split(",") if h]
    try:
        replicas = int(parse_qs(query).get("replicas", ["1"])[0])
        for server in servers:
            urlsplit(server).port  # noqa: B018 - raises on a port that is not a number
    except ValueError as exc:
        raise FatalError(f"broker URL {url!r}: {exc}") from exc
    if not servers or not 1 <= replicas <= 5:
        raise FatalError(f"broker URL {url!r}: give a server, and replicas between 1 and 5")
    return Endpoint(servers, replicas)


def unavailable(exc: BaseException) -> BrokerUnavailable:
    return BrokerUnavailable(f"NATS: {exc}" if str(exc) else f"NATS: {type(exc).__name__}")


async def sent(exchange: Awaitable[_T]) -> _T:
    """Every exchange with the server is awaited here: connection trouble comes out as
    BrokerUnavailable, never a nats-py error."""
    try:
        return await exchange
    except nats.js.errors.ServiceUnavailableError as exc:
        if exc.err_code is not None:  # a real answer, e.g. a full stream (10077)
            raise
        raise unavailable(exc) from exc
    except _TROUBLE as exc:
        raise unavailable(exc) from exc


CAS_ATTEMPTS = 1000  # a compare-and-set retried this often meets more than contention
_R = TypeVar("_R")


def trail(
    name: str,
    subject: str,
    *,
    max_msgs: int | None = None,
    max_bytes: int | None = None,
    max_age: float | None = None,
) -> StreamConfig:
    """A stream kept as a trail (the audit's, the dashboard's series): bounded by count or
    age, the oldest dropped, read by direct gets."""
    return StreamConfig(
        name=name,
        subjects=[subject],
        retention=RetentionPolicy.LIMITS,
        discard=DiscardPolicy.OLD,
        max_msgs=max_msgs,
        max_bytes=max_bytes,
        max_age=max_age,
        allow_direct=True,
    )


async def kv_entry(kv: KeyValue, key: str) -> tuple[bytes | None, int]:
    """A key's value (None: absent or deleted) and the revision to change it from."""
    try:
        found = await sent(kv.get(key))
    except nats.js.errors.KeyNotFoundError as exc:
        marker = exc.entry  # a delete marker: a change must name its revision
        return None, (marker.revision or 0) if marker is not None else 0
    return found.value or b"", found.revision or 0


async def kv_write(kv: KeyValue, key: str, value: bytes, revision: int) -> None:
    """Write only over `revision` (0: only where nothing is); KeyWrongLastSequenceError when
    another write came first."""
    if revision:
        await sent(kv.update(key, value, last=revision))
    else:
        await sent(kv.create(key, value))


async def kv_change(
    kv: KeyValue, key: str, fn: Callable[[bytes | None], tuple[bytes | None, _R]]
) -> _R:
    """Read-modify-write by compare-and-set: `fn` maps the value (None: absent) to the new one
    (None: leave it) and a result; rerun on the latest value when another came first."""
    for _ in range(CAS_ATTEMPTS):
        raw, revision = await kv_entry(kv, key)
        new, result = fn(raw)
        if new is None:
            return result
        try:
            await kv_write(kv, key, new, revision)
        except nats.js.errors.KeyWrongLastSequenceError:
            continue
        return result
    raise BrokerUnavailable(f"NATS: {key} changed by others {CAS_ATTEMPTS} times in a row")


class _Ack(msgspec.Struct):
    """A JetStream publish's answer."""

    seq: int = 0
    error: dict[str, Any] | None = None
    duplicate: bool = False


class Duplicate(int):
    """The sequence a publish answer names when the stream dropped the message as a copy of one
    it stored within its duplicate window (same Nats-Msg-Id): that one's."""


_ACK = msgspec.json.Decoder(_Ack)


class _Collector:
    """The messages one request is answered by, until `limit` or a status message."""

    def __init__(self, done: asyncio.Future[None], limit: int) -> None:
        self.done = done
        self.limit = limit
        self.msgs: list[Msg] = []
        self.end: Msg | None = None

    def add(self, msg: Msg) -> None:
        if self.done.done():
            return
        if msg.headers and msg.headers.get("Status") is not None:
            self.end = msg
            self.done.set_result(None)
            return
        self.msgs.append(msg)
        if len(self.msgs) >= self.limit:
            self.done.set_result(None)


def _acked_consumer(reply: str) -> tuple[str, str]:
    """(stream, consumer) of a delivered message's ack subject: `$JS.ACK.<stream>.<consumer>.`
    and 7 more tokens, or with a domain and an account hash before the stream."""
    parts = reply.split(".")
    if len(parts) == 9:
        return parts[2], parts[3]
    if len(parts) >= 11:
        return parts[4], parts[5]
    return "", ""


class NatsConnection:
    """One client per process side (gateway, worker, CLI) and what it made sure of."""

    def __init__(self, settings: BrokerSettings) -> None:
        self.settings = settings
        self.endpoint = parse_url(settings.url)
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None
        self._opening = asyncio.Lock()
        self._streams: set[str] = set()
        self._kvs: dict[str, KeyValue] = {}
        self._closed = False
        self._acks: dict[str, tuple[asyncio.Future[int], float]] = {}  # token -> (answer, until)
        self._sweeper: asyncio.Task[None] | None = None
        self._collectors: dict[str, _Collector] = {}
        self._pulls: dict[tuple[str, str], _Collector] = {}  # (stream, consumer) -> its pull
        self._pull_locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._tokens = 0
        self._ack_inbox = ""

    @property
    def replicas(self) -> int:
        return self.endpoint.replicas

    async def client(self) -> Client:
        if self._nc is not None and not self._nc.is_closed:
            return self._nc
        async with self._opening:
            if self._nc is None or self._nc.is_closed:
                if self._closed:
                    raise BrokerUnavailable("NATS: connection closed")
                self._nc = await sent(self._open())
                self._ack_inbox = ""  # the last client's reply subscription went with it
                self._js = self._nc.jetstream(timeout=REQUEST_TIMEOUT_S)
        return self._nc

    async def _open(self) -> Client:
        async def quiet(exc: Exception) -> None:
            # nats-py reports every failed reconnect; one line at debug is enough, the calls
            # that meet the outage raise BrokerUnavailable
            log.debug("nats: %s", exc)

        options: dict[str, Any] = {"reconnect_time_wait": 0.2}  # annotated int, used as float
        client = Client()
        await client.connect(
            servers=self.endpoint.servers,
            connect_timeout=2,
            **options,
            max_reconnect_attempts=-1,
            allow_reconnect=True,
            error_cb=quiet,
            # a publish while disconnected waits in the client's buffer for the reconnect;
            # bounded, so an outage is felt as errors rather than memory
            pending_size=16 * 1024 * 1024,
        )
        return client

    async def js(self) -> JetStreamContext:
        await self.client()
        assert self._js is not None
        return self._js

    async def stream(self, config: StreamConfig) -> str:
        """Make sure the stream exists (once per process); returns its name."""
        name = config.name
        assert name is not None
        if name in self._streams:
            return name
        js = await self.js()
        config.num_replicas = self.replicas
        try:
            await sent(js.add_stream(config))
        except nats.js.errors.BadRequestError as exc:
            # made by another process with other limits (e.g. another lane bound): use it as is
            if exc.err_code != 10058:  # stream name already in use with a different config
                raise
            await sent(js.update_stream(config))
        self._streams.add(name)
        return name

    async def kv(
        self, bucket: str, ttl_s: float | None = None, history: int = 1, direct: bool = False
    ) -> KeyValue:
        """The KV bucket, made on first use (`direct`: its stream answers direct gets, made so
        when an older one did not)."""
        found = self._kvs.get(bucket)
        if found is not None:
            return found
        js = await self.js()
        try:
            kv = await sent(js.key_value(bucket))
            if direct:
                info = await sent(js.stream_info(f"KV_{bucket}"))
                if not info.config.allow_direct:
                    info.config.allow_direct = True
                    await sent(js.update_stream(info.config))
        except nats.js.errors.BucketNotFoundError:
            from nats.js.api import KeyValueConfig

            kv = await sent(
                js.create_key_value(
                    KeyValueConfig(
                        bucket=bucket,
                        history=history,
                        ttl=ttl_s,
                        replicas=self.replicas,
                        direct=direct,
                    )
                )
            )
        self._kvs[bucket] = kv
        return kv

    async def _inbox(self) -> str:
        """The one long-lived reply subscription (`<inbox>.*`) every JetStream answer this
        connection waits for comes back on: publish acks, pulled messages, direct gets. A
        subscription per request cost a SUB and an UNSUB message and their bookkeeping."""
        nc = await self.client()
        if not self._ack_inbox:
            inbox = nc.new_inbox()
            sub = await sent(nc.subscribe(f"{inbox}.*"))
            nc.on_raw(sub._id, self._on_reply)  # from the read loop, no task between
            self._ack_inbox = inbox
        return self._ack_inbox

    def _token(self) -> str:
        self._tokens += 1
        return str(self._tokens)

    async def publish_soon(
        self, subject: str, payload: bytes, headers: dict[str, str] | None = None
    ) -> asyncio.Future[int]:
        """Write a JetStream publish now, in call order; the future gives its stream sequence
        (or the server's refusal as APIError; BrokerUnavailable when no answer came in time).
        Several in a row cost one round trip."""
        [answer] = await self.publish_all([(subject, payload, headers)])
        return answer

    async def publish_all(
        self, messages: Sequence[tuple[str, bytes, dict[str, str] | None]]
    ) -> list[asyncio.Future[int]]:
        """`publish_soon` of each (subject, payload, headers), written in order as one buffer
        write (all or none: a refusal raises before any goes); their futures in that order.
        One sweep a second ends those unanswered past REQUEST_TIMEOUT_S (a timer each cost
        more than the publish's own bookkeeping)."""
        if not messages:
            return []
        nc = self._nc
        if nc is None or nc.is_closed or not self._ack_inbox:
            await self._inbox()
            nc = await self.client()
        loop = asyncio.get_running_loop()
        until = loop.time() + REQUEST_TIMEOUT_S
        inbox = self._ack_inbox
        answers: list[asyncio.Future[int]] = []
        tokens: list[str] = []
        outgoing: list[Outgoing] = []
        for subject, payload, headers in messages:
            self._tokens += 1
            token = str(self._tokens)
            answer: asyncio.Future[int] = loop.create_future()
            self._acks[token] = (answer, until)
            tokens.append(token)
            answers.append(answer)
            outgoing.append((subject, payload, f"{inbox}.{token}", headers))
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = loop.create_task(self._sweep())
        try:
            await sent(nc.publish_all(outgoing))
        except BaseException:
            for token in tokens:
                self._acks.pop(token, None)
            raise
        return answers

    async def acked(self, answer: asyncio.Future[_T]) -> _T:
        """The stream sequence of a `publish_soon`; BrokerUnavailable if none came in time."""
        try:
            return await sent(answer)
        except nats.js.errors.APIError as exc:
            if exc.err_code is None and isinstance(exc, nats.js.errors.ServiceUnavailableError):
                raise unavailable(exc) from exc
            raise

    async def publish_acked(
        self, subject: str, payload: bytes, headers: dict[str, str] | None = None
    ) -> int:
        """A JetStream publish and its stream sequence, answered on the long-lived inbox (what
        `js.publish` does with a request, a future and a timer task per call)."""
        return await self.acked(await self.publish_soon(subject, payload, headers))

    async def _sweep(self) -> None:
        """End the publishes left unanswered past their time; stops once none wait."""
        loop = asyncio.get_running_loop()
        while self._acks:
            await asyncio.sleep(1.0)
            now = loop.time()
            late = [t for t, (_, until) in self._acks.items() if until <= now]
            for token in late:
                answer, _ = self._acks.pop(token)
                if not answer.done():
                    answer.set_exception(unavailable(TimeoutError("no answer from the server")))

    def _on_reply(
        self, subject: bytes, reply: bytes, data: bytes, headers: dict[str, str] | None
    ) -> None:
        """A message on the long-lived inbox, from the read loop: a publish answer settles
        its future with no `Msg` built; pulled messages and other answers go to the request
        collecting them."""
        if reply:
            # a pulled message keeps its own subject: its ack subject names whose pull it is
            acked = reply.decode()
            pull = self._pulls.get(_acked_consumer(acked))
            if pull is not None:
                pull.add(Msg(self._nc, subject.decode(), acked, data, headers))  # type: ignore[arg-type]
            return
        token = subject[subject.rfind(b".") + 1 :].decode()
        collector = self._collectors.get(token)
        if collector is not None:
            collector.add(Msg(self._nc, subject.decode(), "", data, headers))  # type: ignore[arg-type]
            return
        waiting = self._acks.pop(token, None)
        if waiting is None:
            return
        answer, _ = waiting
        if answer.done():
            return
        if headers and headers.get("Status") == "503":
            answer.set_exception(unavailable(nats.errors.NoRespondersError()))
            return
        ack = _ACK.decode(data)
        if ack.error is not None:
            try:  # nats-py raises the error's own class rather than returning it
                nats.js.errors.APIError.from_error(ack.error)
            except nats.js.errors.APIError as exc:
                answer.set_exception(exc)
            return
        answer.set_result(Duplicate(ack.seq) if ack.duplicate else ack.seq)

    async def request(
        self, subject: str, payload: bytes, timeout_s: float = REQUEST_TIMEOUT_S
    ) -> Msg:
        nc = await self.client()
        return await sent(nc.request(subject, payload, timeout=timeout_s))

    async def api(self, subject: str, body: dict[str, Any]) -> dict[str, Any]:
        """A JetStream API request ($JS.API.<subject>); an error reply raises APIError."""
        reply = await self.request(f"$JS.API.{subject}", json.dumps(body).encode())
        answer: dict[str, Any] = json.loads(reply.data)
        if "error" in answer:
            raise nats.js.errors.APIError.from_error(answer["error"])
        return answer

    async def first_at(self, stream: str, at: float) -> int | None:
        """The sequence of the first message `stream` stored at or after `at` (unix seconds);
        None: there is none."""
        stamp = datetime.fromtimestamp(at, UTC).isoformat().replace("+00:00", "Z")
        try:
            reply = await self.api(f"STREAM.MSG.GET.{stream}", {"start_time": stamp})
        except nats.js.errors.NotFoundError:
            return None
        return int(reply["message"]["seq"])

    async def replies(
        self, subject: str, body: dict[str, Any], limit: int
    ) -> tuple[list[Msg], Msg | None]:
        """One request answered by many messages (a batched direct get, a pull): the data
        messages, at most `limit`, and the status message that ended them (None: `limit`
        reached). The answers come on the long-lived inbox."""
        return await self.replies_raw(subject, json.dumps(body).encode(), limit)

    async def pull(self, stream: str, consumer: str, batch: int) -> tuple[list[Msg], Msg | None]:
        """Up to `batch` messages a pull consumer has now (a request with `no_wait`), on the
        long-lived inbox: one pull per consumer at a time in this process, so the messages
        are known by the consumer their ack subject names."""
        key = (stream, consumer)
        lock = self._pull_locks.get(key)
        if lock is None:
            lock = self._pull_locks[key] = asyncio.Lock()
        async with lock:
            body = json.dumps({"batch": batch, "no_wait": True}).encode()
            subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}"
            return await self.replies_raw(subject, body, batch, key)

    async def replies_raw(
        self, subject: str, payload: bytes, limit: int, pull: tuple[str, str] | None = None
    ) -> tuple[list[Msg], Msg | None]:
        inbox = await self._inbox()
        nc = await self.client()
        token = self._token()
        collector = _Collector(asyncio.get_running_loop().create_future(), limit)
        self._collectors[token] = collector
        if pull is not None:
            self._pulls[pull] = collector
        try:
            await sent(nc.publish(subject, payload, reply=f"{inbox}.{token}"))
            while not collector.done.done():
                # a long answer is no stall: each message received restarts the wait
                seen = len(collector.msgs)
                try:
                    await sent(asyncio.wait_for(asyncio.shield(collector.done), REQUEST_TIMEOUT_S))
                except BrokerUnavailable:
                    if len(collector.msgs) == seen:
                        raise
            return collector.msgs, collector.end  # an end-of-batch message may follow
        finally:
            self._collectors.pop(token, None)
            if pull is not None:
                self._pulls.pop(pull, None)

    async def last_of_each(
        self, stream: str, subjects: list[str]
    ) -> dict[str, tuple[int, bytes, dict[str, str]]]:
        """The last message of each subject that has one, in one batched direct get
        (`multi_last`, NATS >= 2.11): subject -> (sequence, data, headers)."""
        body = json.dumps({"multi_last": subjects, "batch": len(subjects)}).encode()
        msgs, end = await self.replies_raw(f"$JS.API.DIRECT.GET.{stream}", body, len(subjects))
        if end is not None and (end.headers or {}).get("Status") not in ("204", "404"):
            raise nats.js.errors.APIError.from_msg(end)
        out = {}
        for msg in msgs:
            headers = msg.headers or {}
            out[headers["Nats-Subject"]] = (int(headers["Nats-Sequence"]), msg.data, headers)
        return out

    async def direct_last(
        self, stream: str, subject: str
    ) -> tuple[int, bytes, dict[str, str]] | None:
        """The last message of `subject` (sequence, data, headers) by a direct get; None when
        there is none (a KV entry's delete marker is returned as any message)."""
        msgs, end = await self.replies_raw(f"$JS.API.DIRECT.GET.{stream}.{subject}", b"", 1)
        if not msgs:
            if end is not None and (end.headers or {}).get("Status") not in ("404",):
                raise nats.js.errors.APIError.from_msg(end)
            return None
        msg = msgs[0]
        headers = msg.headers or {}
        return int(headers["Nats-Sequence"]), msg.data, headers

    async def get_batch(
        self, stream: str, subject: str, after: int, count: int
    ) -> list[tuple[int, bytes, dict[str, str]]]:
        """Up to `count` messages of `subject` with sequence > `after`, in one direct get
        (NATS >= 2.11): (sequence, data, headers). 204 ends a batch, 404 finds none."""
        body = {"seq": after + 1, "next_by_subj": subject, "batch": count}
        msgs, end = await self.replies(f"$JS.API.DIRECT.GET.{stream}", body, count)
        if end is not None and (end.headers or {}).get("Status") not in ("204", "404"):
            raise nats.js.errors.APIError.from_msg(end)
        out = []
        for msg in msgs:
            headers = msg.headers or {}
            out.append((int(headers["Nats-Sequence"]), msg.data, headers))
        return out

    async def ping(self) -> bool:
        try:
            nc = await self.client()
            await sent(nc.flush(timeout=2))
            await sent((await self.js()).account_info())
        except (BrokerUnavailable, nats.errors.Error):
            return False
        return True

    @contextlib.asynccontextmanager
    async def subscription(self, subject: str) -> AsyncIterator[asyncio.Queue[Msg]]:
        """A core subscription as a queue of messages, for as long as the block lasts."""
        nc = await self.client()
        got: asyncio.Queue[Msg] = asyncio.Queue()

        async def take(msg: Msg) -> None:
            got.put_nowait(msg)

        sub = await sent(nc.subscribe(subject, cb=take))
        try:
            yield got
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def close(self) -> None:
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        nc, self._nc = self._nc, None
        if nc is not None and not nc.is_closed:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.drain(), 5.0)
            with contextlib.suppress(Exception):
                await nc.close()
