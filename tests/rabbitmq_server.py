"""A private RabbitMQ node for tests: Debian's rabbitmq-server run as a plain process on free
loopback ports, with its own epmd, config, mnesia dir and HOME (Erlang cookie) in a temp dir.

`kill()` then `start()` brings the node back on the same ports and mnesia dir, so durable
queues and their messages survive, as fault tests need.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import struct
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Self

from tokenyard.broker.embedded import EmbeddedProcess
from tokenyard.children import free_port, spawn_tied
from tokenyard.errors import FatalError

__all__ = ["RABBITMQ_BIN", "RabbitServer", "RabbitServerError", "rabbitmq_available"]

# Debian's package; /usr/sbin/rabbitmqctl is a wrapper that insists on the rabbitmq user
RABBITMQ_BIN = Path(os.environ.get("TOKENYARD_RABBITMQ_BIN", "/usr/lib/rabbitmq/bin"))
NODENAME = "rabbit@localhost"
_LOG_NAME = "rabbitmq-server.log"
_CONF_NAME = "rabbitmq.conf"
# what the server sends first once a client's protocol header reaches a live listener: a
# method frame (type 1) on channel 0 carrying connection.start (class 10, method 10)
_AMQP_HEADER = b"AMQP\x00\x00\x09\x01"
_CONNECTION_START = struct.pack(">BH", 1, 0)


class RabbitServerError(FatalError):
    """The test RabbitMQ node could not be found, started or stopped."""


def rabbitmq_available() -> bool:
    """Whether Debian's rabbitmq-server and an epmd are installed here."""
    return (RABBITMQ_BIN / "rabbitmq-server").is_file() and shutil.which("epmd") is not None


class RabbitServer(EmbeddedProcess):
    """One RabbitMQ node (`rabbit@localhost`) over a temp dir; a sync context manager.

    `pid` is the Erlang VM's own pid (the start script is exec'd through), so `kill()` is a
    real kill -9 of the broker.
    """

    _error = RabbitServerError
    _kind = "rabbitmq-server"
    _log_name = _LOG_NAME
    _temp_prefix = "tokenyard-rabbitmq-"
    _probe_errors = (OSError,)
    _not_ready_yet = "the AMQP listener has not answered yet"

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        *,
        keep_data: bool = False,
        config: dict[str, str] | None = None,
    ) -> None:
        """Nothing runs until `start()`; `config` adds or overrides rabbitmq.conf keys."""
        binary = RABBITMQ_BIN / "rabbitmq-server"
        if not rabbitmq_available():
            raise RabbitServerError(
                f"no RabbitMQ: {binary} or epmd missing (apt-get install rabbitmq-server)"
            )
        super().__init__(binary, data_dir, keep_data=keep_data, host="127.0.0.1", port=None)
        self._extra_config = dict(config or {})
        self._dist_port: int | None = None
        self._epmd_port: int | None = None
        self._epmd: subprocess.Popen[bytes] | None = None

    # --- properties ---

    @property
    def url(self) -> str:
        """The amqp:// URL of the default vhost, as guest (allowed: only loopback listens)."""
        return f"amqp://guest:guest@{self._address()}/"

    @property
    def epmd_pid(self) -> int | None:
        """The pid of this node's own epmd while it runs."""
        epmd = self._epmd
        return epmd.pid if epmd is not None and epmd.poll() is None else None

    # --- lifecycle ---

    def start(self, timeout: float = 90.0) -> Self:
        """Start the node (15-20 s on an idle machine) and wait until AMQP answers."""
        return super().start(timeout)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the node gracefully, then its epmd; remove an owned temp dir."""
        try:
            super().stop(timeout)
        finally:
            self._stop_epmd()
            self._dist_port = self._epmd_port = None

    def restart(self, timeout: float = 90.0) -> Self:
        """Stop gracefully if running, then start again on the same ports and data."""
        return super().restart(timeout)

    def ctl(self, *args: str, timeout: float = 60.0) -> str:
        """Run `rabbitmqctl ARGS` against this node; its stdout, or RabbitServerError."""
        return self._cli("rabbitmqctl", *args, timeout=timeout)

    def sync_metadata(self) -> None:
        """Flush the node's DETS tables (Ra's registry of quorum queues) to disk now.

        RabbitMQ 3.10 saves them on a timer: a quorum queue declared within about a second of
        a kill -9 comes back as a new, empty Raft server that never elects a leader.
        """
        self.ctl("eval", "[ok = dets:sync(T) || T <- dets:all()], ok.")

    # --- hooks ---

    def _launch(self, data_dir: Path, timeout: float) -> None:
        # ports picked once and kept, so a restart after kill() finds the same node; a pick
        # racing with another process shows up as a failed start, not a wrong server
        first = self._port is None
        try:
            self._launch_on_ports(data_dir, timeout)
        except BaseException:
            if first:  # a retry picks new ports
                self._port = self._dist_port = None
            raise

    def _launch_on_ports(self, data_dir: Path, timeout: float) -> None:
        if self._port is None:
            self._port = free_port(self._host)
        if self._dist_port is None:
            self._dist_port = free_port(self._host)
        if self._epmd_port is None:
            self._epmd_port = free_port(self._host)
        for sub in ("mnesia", "log", "home"):
            (data_dir / sub).mkdir(exist_ok=True)
        (data_dir / _CONF_NAME).write_text(self._config_text())
        # no plugins, whatever /etc/rabbitmq enables: management would listen on 15672
        (data_dir / "enabled_plugins").write_text("[].\n")
        self._ensure_epmd(data_dir)
        env = self._env(data_dir)
        # env(1) hands the start script a clean environment and execs it; the script execs
        # erl, erl execs the VM, so the pid the base class holds is the broker's own
        argv = ["env", "-i", *(f"{k}={v}" for k, v in env.items()), str(self._binary)]
        self._run(argv, data_dir, timeout)

    @contextlib.contextmanager
    def _readiness(self) -> Iterator[Callable[[], bool]]:
        # RabbitMQ opens its listeners in one of the last boot steps, after the queues'
        # recovery; a connection.start frame means a client can log in
        def ready() -> bool:
            with socket.create_connection((self._host, self._port or 0), timeout=2.0) as sock:
                sock.sendall(_AMQP_HEADER)
                return sock.recv(3) == _CONNECTION_START

        yield ready

    # --- internals ---

    def _config_text(self) -> str:
        settings = {
            "listeners.tcp.default": f"{self._host}:{self._port}",
            # guest may log in from anywhere: nothing but loopback listens
            "loopback_users": "none",
            # a test's consumer may hold a delivery for long (a paused worker, a debugger);
            # the default 30 min closes its channel mid-test
            "consumer_timeout": "3600000",
            "log.console": "false",
            "log.file.level": "info",
            **self._extra_config,
        }
        return "".join(f"{key} = {value}\n" for key, value in settings.items())

    def _env(self, data_dir: Path) -> dict[str, str]:
        loopback = "-kernel inet_dist_use_interface {127,0,0,1}"
        return {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "LANG": "C.UTF-8",
            "HOME": str(data_dir / "home"),  # the Erlang cookie lives here
            "ERL_EPMD_PORT": str(self._epmd_port),
            "ERL_EPMD_ADDRESS": self._host,
            "RABBITMQ_NODENAME": NODENAME,
            "RABBITMQ_NODE_IP_ADDRESS": self._host,
            "RABBITMQ_NODE_PORT": str(self._port),
            "RABBITMQ_DIST_PORT": str(self._dist_port),
            "RABBITMQ_MNESIA_BASE": str(data_dir / "mnesia"),
            "RABBITMQ_LOG_BASE": str(data_dir / "log"),
            "RABBITMQ_CONFIG_FILE": str(data_dir / _CONF_NAME),
            # absent files: /etc/rabbitmq's must not apply
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(data_dir / "advanced.config"),
            "RABBITMQ_CONF_ENV_FILE": str(data_dir / "rabbitmq-env.conf"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(data_dir / "enabled_plugins"),
            "RABBITMQ_PID_FILE": str(data_dir / "rabbitmq.pid"),
            # exec the VM in place of the script (no shell between us and the broker);
            # -noinput, which the script leaves out in this mode, keeps the shell off stdin
            "RABBITMQ_ALLOW_INPUT": "true",
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": f"-noinput {loopback}",
            # the CLI tools start a VM of their own: loopback too, ports beside the node's
            "RABBITMQ_CTL_ERL_ARGS": loopback,
        }

    def _ensure_epmd(self, data_dir: Path) -> None:
        # Our own epmd, on our port and loopback only, as our child: the VM would otherwise
        # daemonize one that outlives the test run. It stays up across kill()/start().
        if self.epmd_pid is not None:
            return
        epmd = shutil.which("epmd") or "epmd"
        argv = [epmd, "-address", self._host, "-port", str(self._epmd_port)]
        with open(data_dir / "epmd.log", "ab") as out:
            self._epmd = spawn_tied(
                argv,
                signal.SIGKILL,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + 10.0
        while True:
            if self._epmd.poll() is not None:
                raise RabbitServerError(
                    f"epmd exited with code {self._epmd.returncode} on port {self._epmd_port}"
                )
            with (
                contextlib.suppress(OSError),
                socket.create_connection((self._host, self._epmd_port or 0), timeout=1.0),
            ):
                return
            if time.monotonic() >= deadline:
                self._stop_epmd()
                raise RabbitServerError(f"epmd not listening on {self._epmd_port} after 10s")
            time.sleep(0.05)

    def _stop_epmd(self) -> None:
        epmd, self._epmd = self._epmd, None
        if epmd is None:
            return
        if epmd.poll() is None:
            epmd.terminate()
            try:
                epmd.wait(5.0)
            except subprocess.TimeoutExpired:
                epmd.kill()
                epmd.wait(5.0)

    def _cli(self, tool: str, *args: str, timeout: float) -> str:
        if not self.running:
            raise RabbitServerError(f"{tool} {' '.join(args)}: the node is not running")
        env = self._env(self._data_dir)
        try:
            done = subprocess.run(
                [str(RABBITMQ_BIN / tool), "-n", NODENAME, *args],
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RabbitServerError(f"{tool} {' '.join(args)}: {exc}") from exc
        if done.returncode != 0:
            raise RabbitServerError(
                f"{tool} {' '.join(args)} exited {done.returncode}: {done.stderr.strip()}"
            )
        return done.stdout
