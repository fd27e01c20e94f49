"""The local `serve`: what it records in its data dir while it runs, and the one rule by which
the other commands find it when no broker (or gateway URL) is named.

`serve` writes `serve.json` into its data dir once its gateway's port is bound, and removes it
when it stops. A command given no `--broker`, TOKENYARD_BROKER_URL or config-file URL looks in
TOKENYARD_DATA_DIR when set, else in serve's default data dirs under the working directory
(`.tokenyard/valkey`, `.tokenyard/nats`), and takes the newest record whose process still runs.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import msgspec

DATA_DIR_ENV = "TOKENYARD_DATA_DIR"
RECORD = "serve.json"
DEFAULT_DATA_DIRS = (Path(".tokenyard", "valkey"), Path(".tokenyard", "nats"))


class LocalServe(msgspec.Struct, frozen=True, kw_only=True):
    """What a running `serve` tells the commands beside it."""

    pid: int
    started_at: float  # unix seconds
    broker_url: str
    tables_url: str = ""
    prefix: str = "ty"
    api_url: str  # the gateway's base URL, http://host:port
    model: str
    engine: str
    workers: str  # a number, or `auto`


def record(data_dir: Path, serve: LocalServe) -> Path:
    """Write `serve`'s record into its data dir, readable by its owner only (the broker URL may
    hold a password); replaced atomically, so a reader never sees half of it."""
    data_dir.mkdir(parents=True, exist_ok=True)
    path = data_dir / RECORD
    partial = data_dir / f".{RECORD}.{os.getpid()}"
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(msgspec.json.encode(serve))
    partial.replace(path)
    return path


def forget(data_dir: Path) -> None:
    """Remove this process's record (not one a newer serve wrote over it)."""
    path = data_dir / RECORD
    found = _read(path)
    if found is not None and found.pid == os.getpid():
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def find(environ: dict[str, str] | None = None) -> LocalServe | None:
    """The running local serve, if any (see the module's docstring)."""
    environ = dict(os.environ) if environ is None else environ
    given = environ.get(DATA_DIR_ENV)
    dirs = (Path(given),) if given else DEFAULT_DATA_DIRS
    running = [
        found
        for found in (_read(d / RECORD) for d in dirs)
        if found is not None and _running(found.pid)
    ]
    return max(running, key=lambda s: s.started_at, default=None)


def _read(path: Path) -> LocalServe | None:
    try:
        return msgspec.json.decode(path.read_bytes(), type=LocalServe)
    except (OSError, msgspec.DecodeError):  # none, not ours to read, or from another version
        return None


def _running(pid: int) -> bool:
    """Whether `pid` is a live tokenyard process (a record a killed serve left behind, whose pid
    another program now has, does not count)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False  # another user's process: not the serve that wrote a file we can read
    if not sys.platform.startswith("linux"):
        return True
    try:
        return b"tokenyard" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
