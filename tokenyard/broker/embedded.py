"""The lifecycle shared by the private servers tokenyard starts itself (Valkey, nats-server):
data dir, log, start until ready, graceful stop, kill and restart, tied to this process."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import ClassVar, Literal, Self

from tokenyard.children import spawn_tied
from tokenyard.errors import TokenyardError

__all__ = ["EmbeddedProcess", "Fsync", "checked_fsync"]

# how often a server forces its log to disk: Valkey's appendfsync words, nats-server's too
Fsync = Literal["always", "everysec", "no"]
_FSYNCS: tuple[Fsync, ...] = ("always", "everysec", "no")


def checked_fsync(name: str, value: str) -> Fsync:
    """`value` as an Fsync, or a ValueError naming the setting `name`."""
    for word in _FSYNCS:
        if value == word:
            return word
    raise ValueError(f"{name} must be always, everysec or no, not {value!r}")


log = logging.getLogger(__name__)


class EmbeddedProcess(ABC):
    """One private server process over a data dir (a temp dir of its own unless given)."""

    _error: ClassVar[type[TokenyardError]]
    _kind: ClassVar[str]  # how messages name the server
    _log_name: ClassVar[str]
    _temp_prefix: ClassVar[str]
    # what the readiness check raises while the server is not there yet
    _probe_errors: ClassVar[tuple[type[Exception], ...]]
    _not_ready_yet: ClassVar[str]  # the reason given when no check has raised

    def __init__(
        self,
        binary: Path,
        data_dir: str | os.PathLike[str] | None,
        *,
        keep_data: bool,
        host: str,
        port: int | None,
    ) -> None:
        """Own a fresh temp dir when `data_dir` is None; nothing runs until `start()`."""
        self._binary = binary
        self._owns_dir = data_dir is None
        self._data_dir = (
            self._new_temp_dir() if data_dir is None else Path(data_dir).expanduser().resolve()
        )
        self._dir_removed = False
        self._keep_data = keep_data
        self._host = host
        self._given_port = port
        self._port = port
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
    def log_path(self) -> Path:
        """The server's log file (also receives its stdout/stderr)."""
        return self._data_dir / self._log_name

    @property
    def port(self) -> int | None:
        """The client TCP port; None before the first `start()` unless one was given (and over
        a unix socket)."""
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
    @abstractmethod
    def url(self) -> str:
        """The URL clients connect to."""

    # --- lifecycle ---

    def start(self, timeout: float = 30.0) -> Self:
        """Start the server and wait until it is ready to serve."""
        if self.running:
            raise self._error(f"{self._kind} already running (pid {self.pid})")
        self._reap()
        self._launch(self._ensure_data_dir(), timeout)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Shut down gracefully (SIGKILL after `timeout`); remove an owned temp dir."""
        self._terminate(timeout)
        self._port = self._given_port
        if self._owns_dir and not self._keep_data and not self._dir_removed:
            shutil.rmtree(self._data_dir, ignore_errors=True)
            self._dir_removed = True

    def kill(self) -> None:
        """SIGKILL the server, leaving data dir and port as they are (for fault tests)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
        self._reap()

    def restart(self, timeout: float = 30.0) -> Self:
        """Stop gracefully if running, then start over the same data dir and port."""
        self._terminate(timeout)
        return self.start(timeout)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._where()} pid={self.pid} dir={self._data_dir}>"

    # --- hooks ---

    @abstractmethod
    def _launch(self, data_dir: Path, timeout: float) -> None:
        """Write the config into `data_dir` and `_run` the server until it is ready."""

    @abstractmethod
    def _readiness(self) -> contextlib.AbstractContextManager[Callable[[], bool]]:
        """A check, true once the server serves; it may raise `_probe_errors` meanwhile."""

    def _exit_error(self, code: int) -> Exception:
        """What to raise when the server exits with `code` before it is ready."""
        return self._error(
            f"{self._binary.name} exited with code {code} during startup\n{self._log_tail()}"
        )

    def _where(self) -> str:
        return f"{self._host}:{self._port}"

    # --- internals ---

    def _new_temp_dir(self) -> Path:
        return Path(tempfile.mkdtemp(prefix=self._temp_prefix)).resolve()

    def _ensure_data_dir(self) -> Path:
        if self._dir_removed:
            self._data_dir = self._new_temp_dir()
            self._dir_removed = False
        else:
            self._data_dir.mkdir(parents=True, exist_ok=True)
        return self._data_dir

    def _address(self) -> str:
        if self._port is None:
            raise self._error("the server has no port yet; call start() first")
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"{host}:{self._port}"

    def _run(self, argv: Sequence[str], data_dir: Path, timeout: float) -> None:
        try:
            # Errors before the server opens its log go to stderr, so both streams append to
            # the log. A new session keeps a terminal's Ctrl-C away from the server, leaving
            # shutdown to stop(); an orphaned server would hold its port and data dir forever,
            # so it dies with this process.
            with open(self.log_path, "ab") as out:
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
            raise self._error(f"cannot run {self._binary}: {exc}") from exc
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.kill()
            raise

    def _wait_ready(self, timeout: float) -> None:
        proc = self._proc
        assert proc is not None
        deadline = time.monotonic() + timeout
        delay = 0.01
        last_error = self._not_ready_yet
        with self._readiness() as ready:
            while True:
                code = proc.poll()
                if code is not None:
                    raise self._exit_error(code)
                try:
                    if ready():
                        return
                except self._probe_errors as exc:
                    last_error = str(exc)
                if time.monotonic() >= deadline:
                    raise self._error(
                        f"{self._binary.name} (pid {proc.pid}) not ready after {timeout:.1f}s "
                        f"(last error: {last_error})\n{self._log_tail()}"
                    )
                time.sleep(delay)
                delay = min(delay * 2, 0.1)

    def _terminate(self, timeout: float) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            # SIGTERM is each server's clean shutdown (Valkey fsyncs its AOF, nats-server
            # flushes JetStream's store) and needs no client connection while it is busy.
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning(
                    "%s pid %s ignored SIGTERM for %.1fs; sending SIGKILL",
                    self._kind,
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
