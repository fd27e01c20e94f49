"""How commands find the local `serve` (fleet/local.py) and where it ranks among the ways to name
a broker (cli/options.py): flag > env > file > the running serve's record > none."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tokenyard.cli.options import broker_settings
from tokenyard.config import CONFIG_ENV
from tokenyard.errors import FatalError
from tokenyard.fleet.local import DATA_DIR_ENV, RECORD, LocalServe, find, forget, record


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
