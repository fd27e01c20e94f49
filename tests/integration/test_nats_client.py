"""The NATS backend's client (tokenyard/broker/nats/client.py) against a real nats-server: its
own publish writes what nats-py's would (headers, replies, the refusals that guard the
protocol), and a raw subscription gets every message, in order, with its headers."""

from __future__ import annotations

import asyncio

import nats.errors
import pytest
from nats.aio.msg import Msg

from tokenyard.broker.nats.client import Client, delivered
from tokenyard.broker.nats.embedded import EmbeddedNats


async def _client(url: str) -> Client:
    nc = Client()
    await nc.connect(servers=[url], connect_timeout=5)
    return nc


Seen = list[tuple[str, str, bytes, dict[str, str] | None]]


async def _collect(nc: Client, subjects: str, count: int) -> tuple[Seen, asyncio.Event]:
    """What arrives on `subjects` (subject, reply, data, headers), and an event set once
    `count` messages came."""
    seen: Seen = []
    got = asyncio.Event()

    async def take(msg: Msg) -> None:
        seen.append((msg.subject, msg.reply, msg.data, msg.headers))
        if len(seen) == count:
            got.set()

    await nc.subscribe(subjects, cb=take)
    return seen, got


async def test_publish_now_writes_what_nats_py_publish_would(nats_server: EmbeddedNats) -> None:
    nc = await _client(nats_server.url)
    try:
        seen, got = await _collect(nc, "tyclient.pub.>", 4)
        await nc.publish_now("tyclient.pub.a", b"plain", "", None)
        await nc.publish_now("tyclient.pub.b", b"", "reply.to", None)
        headers = {"Ty-Rev": " 12 ", "Nats-Msg-Id": "id\r\nPUB evil 1\r\nx"}
        await nc.publish_now("tyclient.pub.c", b"with headers", "r.1", headers)
        await nc.publish("tyclient.pub.d", b"nats-py's", reply="r.1", headers=headers)
        await asyncio.wait_for(got.wait(), 10)
        assert seen[0] == ("tyclient.pub.a", "", b"plain", None)
        assert seen[1] == ("tyclient.pub.b", "reply.to", b"", None)
        # values stripped, CR/LF blanked (no second command smuggled in): as nats-py does
        assert seen[2][:3] == ("tyclient.pub.c", "r.1", b"with headers")
        assert seen[2][3] == seen[3][3] == {"Ty-Rev": "12", "Nats-Msg-Id": "id  PUB evil 1  x"}
        for bad in ("", "a b", "a\r\nPUB x 1", "a\tb"):
            with pytest.raises(nats.errors.BadSubjectError):
                await nc.publish_now(bad, b"", "", None)
        assert nc.stats["out_msgs"] >= 4
    finally:
        await nc.close()
    with pytest.raises(nats.errors.ConnectionClosedError):
        await nc.publish_now("tyclient.pub.a", b"", "", None)


async def test_publish_all_writes_each_message_in_order_or_none(
    nats_server: EmbeddedNats,
) -> None:
    nc = await _client(nats_server.url)
    try:
        seen, got = await _collect(nc, "tyclient.all.>", 3)
        sent_before = nc.stats["out_msgs"]
        # a refused message (whitespace in its subject) refuses the whole call: none goes
        with pytest.raises(nats.errors.BadSubjectError):
            await nc.publish_all(
                [("tyclient.all.x", b"not sent", "", None), ("a b", b"", "", None)]
            )
        with pytest.raises(nats.errors.MaxPayloadError):
            await nc.publish_all([("tyclient.all.y", b"x" * (nc.max_payload + 1), "", None)])
        await nc.publish_all(
            [
                ("tyclient.all.a", b"plain", "", None),
                ("tyclient.all.b", b"", "reply.to", {"Ty-Rev": " 3 "}),
                ("tyclient.all.c", b"last", "r.1", {"Nats-Msg-Id": "id\r\nPUB evil 1\r\nx"}),
            ]
        )
        await asyncio.wait_for(got.wait(), 10)
        await asyncio.sleep(0.2)  # the refused calls' messages would have come before these
        assert seen == [
            ("tyclient.all.a", "", b"plain", None),
            ("tyclient.all.b", "reply.to", b"", {"Ty-Rev": "3"}),
            ("tyclient.all.c", "r.1", b"last", {"Nats-Msg-Id": "id  PUB evil 1  x"}),
        ]
        assert nc.stats["out_msgs"] - sent_before >= 3
    finally:
        await nc.close()
    with pytest.raises(nats.errors.ConnectionClosedError):
        await nc.publish_all([("tyclient.all.a", b"", "", None)])


async def test_a_raw_subscription_gets_every_message_in_order(nats_server: EmbeddedNats) -> None:
    nc = await _client(nats_server.url)
    try:
        seen: list[tuple[bytes, bytes, bytes, dict[str, str] | None]] = []
        sub = await nc.subscribe("tyclient.raw.*")
        nc.on_raw(sub._id, lambda *args: seen.append(args))
        before = nc.stats["in_msgs"]
        for k in range(500):  # more than one read of the socket
            headers = {"N": str(k)} if k % 2 else None
            await nc.publish_now(f"tyclient.raw.{k}", b"x" * k, "" if k % 3 else "r", headers)
        await nc.flush()
        deadline = asyncio.get_running_loop().time() + 10
        while len(seen) < 500 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        assert [s[0] for s in seen] == [f"tyclient.raw.{k}".encode() for k in range(500)]
        for k, (_, reply, data, headers) in enumerate(seen):
            assert reply == (b"" if k % 3 else b"r") and data == b"x" * k
            assert headers == ({"N": str(k)} if k % 2 else None)
        assert nc.stats["in_msgs"] - before == 500  # counted as nats-py counts (the benches)
    finally:
        await nc.close()


async def test_a_raw_handler_that_raises_leaves_the_connection_up(
    nats_server: EmbeddedNats, caplog: pytest.LogCaptureFixture
) -> None:
    nc = await _client(nats_server.url)
    try:
        seen: list[bytes] = []

        def handler(_: bytes, __: bytes, data: bytes, ___: dict[str, str] | None) -> None:
            if data == b"bad":
                raise ValueError("a message this handler cannot read")
            seen.append(data)

        sub = await nc.subscribe("tyclient.fail")
        nc.on_raw(sub._id, handler)
        for data in (b"bad", b"good"):
            await nc.publish_now("tyclient.fail", data, "", None)
        await nc.flush()  # answered after both messages: the read loop went on past the error
        deadline = asyncio.get_running_loop().time() + 10
        while not seen and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        assert seen == [b"good"] and nc.is_connected
        assert "could not be handled" in caplog.text
    finally:
        await nc.close()


def test_delivered_reads_both_ack_subject_shapes() -> None:
    msg = Msg(_client=None, reply="$JS.ACK.LANE.cons.1.42.7.1700000000000000000.3")  # type: ignore[arg-type]
    assert delivered(msg) == ("LANE", 42)
    domain = "$JS.ACK.dom.acchash.LANE.cons.2.43.8.1700000000000000000.0.rnd"
    msg = Msg(_client=None, reply=domain)  # type: ignore[arg-type]
    assert delivered(msg) == ("LANE", 43)
