"""How commands find the local `serve` (fleet/local.py), from its directory or one below, and
where it ranks among the ways to name a broker (cli/options.py): flag > env > file > the running
serve's record > none; and the lock that keeps one serve per data dir."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tokenyard.cli.options import broker_settings
from tokenyard.config import CONFIG_ENV
from tokenyard.errors import FatalError
from tokenyard.fleet.local import (
    DATA_DIR_ENV,
    LOCK,
    RECORD,
    LocalServe,
    check_free,
    find,
    forget,
    hold,
    record,
)


@pytest.fixture
def serving() -> Iterator[int]:
    """The pid of a live process whose command line names tokenyard, as serve's does."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "tokenyard"])
    cmdline = Path(f"/proc/{proc.pid}/cmdline")
    while b"tokenyard" not in cmdline.read_bytes():  # forked, not yet exec'd: the parent's
        time.sleep(0.01)
    yield proc.pid
    proc.kill()
    proc.wait()


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory with nothing naming a broker."""
    for name in ("TOKENYARD_BROKER_URL", "TOKENYARD_BROKER_PREFIX", DATA_DIR_ENV, CONFIG_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def serve_record(pid: int, started_at: float = 1.0, port: int = 6379) -> LocalServe:
    return LocalServe(
        pid=pid,
        started_at=started_at,
        broker_url=f"redis://127.0.0.1:{port}/0",
        prefix="mine",
        api_url="http://127.0.0.1:8000",
        model="tiny",
        engine="sim",
        workers="1",
    )


def test_a_running_serve_is_found_in_the_default_data_dirs(here: Path, serving: int) -> None:
    assert find() is None
    record(here / ".tokenyard" / "valkey", serve_record(serving, started_at=1.0, port=1))
    record(here / ".tokenyard" / "nats", serve_record(serving, started_at=2.0, port=2))
    found = find()
    assert found is not None and found.broker_url == "redis://127.0.0.1:2/0"  # the newest
    assert (here / ".tokenyard" / "nats" / RECORD).stat().st_mode & 0o777 == 0o600
    # another data dir, by name: only there
    assert find({DATA_DIR_ENV: str(here / "elsewhere")}) is None
    record(here / "elsewhere", serve_record(serving, port=3))
    named = find({DATA_DIR_ENV: str(here / "elsewhere")})
    assert named is not None and named.broker_url == "redis://127.0.0.1:3/0"


def test_a_record_whose_process_is_gone_or_is_not_tokenyard_is_ignored(here: Path) -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        record(here / ".tokenyard" / "valkey", serve_record(sleeper.pid))  # a reused pid
        assert find() is None
    finally:
        sleeper.kill()
        sleeper.wait()
    record(here / ".tokenyard" / "valkey", serve_record(sleeper.pid))  # now gone
    assert find() is None
    (here / ".tokenyard" / "valkey" / RECORD).write_text("{not json")
    assert find() is None


def test_forget_removes_only_this_process_record(here: Path, serving: int) -> None:
    data = here / ".tokenyard" / "valkey"
    record(data, serve_record(serving))
    forget(data)  # not ours: a newer serve wrote it
    assert (data / RECORD).exists()


def test_a_named_broker_beats_the_local_serve_and_none_is_refused(
    here: Path, serving: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(FatalError, match="--broker URL or set TOKENYARD_BROKER_URL"):
        broker_settings(None, None)
    record(here / ".tokenyard" / "valkey", serve_record(serving))
    local = broker_settings(None, None)
    assert (local.url, local.prefix) == ("redis://127.0.0.1:6379/0", "mine")
    assert broker_settings(None, "given").prefix == "given"  # a named prefix stays
    assert broker_settings("redis://flag:1/0", None).url == "redis://flag:1/0"
    monkeypatch.setenv("TOKENYARD_BROKER_URL", "redis://env:1/0")
    named = broker_settings(None, None)
    assert (named.url, named.prefix) == ("redis://env:1/0", "ty")
    monkeypatch.delenv("TOKENYARD_BROKER_URL")
    # serve itself (required=False) never takes another serve's broker
    assert broker_settings(None, None, required=False).url == ""


def test_the_nearest_running_serve_is_found_from_a_subdirectory(here: Path, serving: int) -> None:
    deep = here / "a" / "b" / "c"
    deep.mkdir(parents=True)
    record(here / ".tokenyard" / "valkey", serve_record(serving, port=1))
    found = find(cwd=deep)
    assert found is not None and found.broker_url == "redis://127.0.0.1:1/0"
    # a nearer record of a serve that is gone does not hide it; a nearer running one wins
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    record(here / "a" / ".tokenyard" / "valkey", serve_record(int(gone.stdout), port=2))
    assert (found := find(cwd=deep)) is not None and found.broker_url.endswith(":1/0")
    record(here / "a" / "b" / ".tokenyard" / "nats", serve_record(serving, port=3))
    assert (found := find(cwd=deep)) is not None and found.broker_url.endswith(":3/0")
    assert find({DATA_DIR_ENV: str(here / "elsewhere")}, cwd=deep) is None  # only there


def test_one_serve_holds_a_data_dir_and_a_second_is_refused_naming_it(here: Path) -> None:
    data = here / ".tokenyard" / "valkey"
    check_free(data)
    assert not data.exists()  # looking created nothing
    with hold(data):
        pid = os.getpid()
        for second in (lambda: check_free(data), lambda: hold(data).__enter__()):
            with pytest.raises(FatalError) as refused:
                second()
            assert str(refused.value).startswith(
                f"a serve already runs on {data} (pid {pid}, still starting); stop it first"
            )
        record(data, serve_record(pid))  # once it listens, the line gives its URL
        with pytest.raises(FatalError, match=rf"\(pid {pid}, http://127.0.0.1:8000\)"):
            check_free(data)
    check_free(data)  # released at the block's end
    with hold(data):
        pass


def test_a_killed_serve_s_lock_is_released_by_the_kernel(here: Path) -> None:
    data = here / "data"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_AND_SLEEP, str(data)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(FatalError, match=f"pid {holder.pid}, still starting"):
            check_free(data)
    finally:
        holder.kill()  # SIGKILL: no code of its runs
        holder.wait()
    with hold(data):
        assert (data / LOCK).read_text() == str(os.getpid())


HOLD_AND_SLEEP = """
import sys, time
from pathlib import Path
from tokenyard.fleet.local import hold
with hold(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(60)
"""
