"""The local `serve`: the lock that makes it the only one on its data dir, what it records
there while it runs, and the one rule by which the other commands find it when no broker (or
gateway URL) is named.

`serve` holds an OS lock on `serve.lock` in its data dir for its whole life (released by the
kernel however it ends, SIGKILL too), so a second serve there stops at once, naming the first.
It writes `serve.json` there once its gateway's port is bound, and removes it when it stops. A
command given no `--broker`, TOKENYARD_BROKER_URL or config-file URL looks in TOKENYARD_DATA_DIR
when set, else in serve's default data dirs (`.tokenyard/valkey`, `.tokenyard/nats`) of the
working directory and then of each directory above it, as git finds its repository: the
nearest running serve's record (the newest, where one directory holds two) names it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import msgspec

from tokenyard.errors import FatalError

DATA_DIR_ENV = "TOKENYARD_DATA_DIR"
RECORD = "serve.json"
LOCK = "serve.lock"
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


def find(environ: Mapping[str, str] | None = None, cwd: Path | None = None) -> LocalServe | None:
    """The running local serve, if any (see the module's docstring)."""
    environ = os.environ if environ is None else environ
    given = environ.get(DATA_DIR_ENV)
    if given:
        return _newest_running([Path(given)])
    try:
        here = (cwd or Path.cwd()).resolve()
    except FileNotFoundError:  # the working directory was removed
        return None
    for directory in (here, *here.parents):
        found = _newest_running([directory / d for d in DEFAULT_DATA_DIRS])
        if found is not None:
            return found
    return None


@contextlib.contextmanager
def hold(data_dir: Path) -> Iterator[None]:
    """Hold `data_dir`'s lock while the block runs: one serve per data dir. A second serve is
    refused in one line naming the first; the kernel drops the lock when its holder dies."""
    data_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(data_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o600)  # not inherited by children
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FatalError(_held_by(data_dir, fd)) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)  # who holds it, for the next one's line
        yield
    finally:
        os.close(fd)  # releases the lock; the file stays (unlinking it would race a new holder)


def check_free(data_dir: Path) -> None:
    """Refuse at once, creating nothing, when a serve holds `data_dir` (`hold` decides, later)."""
    try:
        fd = os.open(data_dir / LOCK, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FatalError(_held_by(data_dir, fd)) from None
    finally:
        os.close(fd)


def _held_by(data_dir: Path, fd: int) -> str:
    """The refusal of a second serve: the first's pid and, once it listens, its URL."""
    pid = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
    found = _read(data_dir / RECORD)
    where = found.api_url if found is not None and str(found.pid) == pid else "still starting"
    return (
        f"a serve already runs on {data_dir} (pid {pid}, {where}); stop it first, or give "
        "this one another --data-dir"
    )


def _newest_running(dirs: Iterable[Path]) -> LocalServe | None:
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
