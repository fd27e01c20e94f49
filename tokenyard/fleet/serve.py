"""`tokenyard serve`: a private Valkey (or nats-server; or RabbitMQ lanes given by URL, their
tables on a private Valkey), worker processes and the gateway on one machine."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Self

import msgspec
from prometheus_client import CollectorRegistry

from tokenyard.broker import AMQP_SCHEMES
from tokenyard.broker.nats.embedded import EmbeddedNats
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.children import spawn_tied
from tokenyard.config import BrokerSettings
from tokenyard.errors import FAILURE_FILE_ENV
from tokenyard.fleet.autoscale import AutoscaleConfig
from tokenyard.fleet.launch import stop_processes, tokenyard_command
from tokenyard.logs import LOG_NAME_ENV
from tokenyard.metrics import add_worker_metrics

# what `--broker` may name instead of a URL: the private server serve starts
Embedded = Literal["valkey", "nats"]
EMBEDDED: tuple[Embedded, ...] = ("valkey", "nats")


@dataclass(kw_only=True, eq=False)
class Stack:
    """Starts what `serve` needs in order and stops it in reverse; workers drain on the way out."""

    # the settings serve was given (flags, env, file): its prefix and fsync policy, and what the
    # gateway and the workers of a private server take too (the Kafka audit log's, ...)
    given: BrokerSettings
    external: BrokerSettings | None  # a broker to use; None: a private `embedded` in `data_dir`
    model: str  # what the workers load
    engine: str
    n_workers: int
    max_seqs: int | None
    data_dir: Path
    drain_timeout_s: float = 30.0
    # --workers auto: a supervisor thread sizes `workers`; its gauges join the gateway's
    autoscale: AutoscaleConfig | None = None
    log_format: str = "text"
    log_level: str = "INFO"
    embedded: Embedded = "valkey"
    # the model's names (the first: its lanes' name); empty: `model` as given
    served_names: tuple[str, ...] = ()
    server: EmbeddedServer | EmbeddedNats | None = field(default=None, init=False)
    # amqp:// lanes given no tables URL: a private Valkey in `data_dir` holds their tables
    tables_server: EmbeddedServer | None = field(default=None, init=False)
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list, init=False)
    registry: CollectorRegistry = field(default_factory=CollectorRegistry, init=False)
    # workers write their metrics here (prometheus_client's multiprocess mode); `registry`,
    # which the gateway's /metrics serves, reads them
    metrics_dir: Path | None = field(default=None, init=False)
    # why serve must stop: a worker exited on its own (it could not start, or died); set by
    # the worker's watcher thread, which then sends SIGTERM to this process
    failure: str | None = field(default=None, init=False)
    _stopping: bool = field(default=False, init=False)
    _worker_env: dict[str, str] | None = field(default=None, init=False)
    _supervisor: threading.Thread | None = field(default=None, init=False)
    _supervisor_stop: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = field(
        default=None, init=False
    )

    @property
    def broker_url(self) -> str:
        if self.external is not None:
            return self.external.url
        assert self.server is not None, "stack not started"
        return self.server.url

    @property
    def tables_url(self) -> str:
        """Where amqp:// lanes keep their tables ('' for every other broker)."""
        if self.tables_server is not None:
            return self.tables_server.url
        return self.external.tables_url if self.external is not None else ""

    @property
    def prefix(self) -> str:
        return self.given.prefix

    @property
    def appendfsync(self) -> Literal["always", "everysec", "no"]:
        return self.given.appendfsync

    @property
    def broker_settings(self) -> BrokerSettings:
        """The given settings, with the URLs of the servers this stack started."""
        return msgspec.structs.replace(self.given, url=self.broker_url, tables_url=self.tables_url)

    def start(self) -> None:
        external = self.external
        if external and external.url.startswith(AMQP_SCHEMES) and not external.tables_url:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            self.tables_server = EmbeddedServer(
                self.data_dir, keep_data=True, appendfsync=self.appendfsync
            ).start()
        if self.external is None:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            # the data dir is kept: jobs accepted before a restart are still there after it
            if self.embedded == "nats":
                self.server = EmbeddedNats(
                    self.data_dir, keep_data=True, sync=self.appendfsync
                ).start()
            else:
                self.server = EmbeddedServer(
                    self.data_dir, keep_data=True, appendfsync=self.appendfsync
                ).start()
        self.metrics_dir = Path(tempfile.mkdtemp(prefix="tokenyard-metrics-"))
        add_worker_metrics(self.registry, self.metrics_dir)
        self._worker_env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(self.metrics_dir)}
        if self.autoscale is not None:
            # each line of an autoscaled worker names it by its pid, as the supervisor's do
            self._worker_env[LOG_NAME_ENV] = "worker-{pid}"
            self._start_supervisor(self.autoscale)
            return
        for index in range(self.n_workers):
            self.workers.append(self._spawn_watched(index + 1))

    def _spawn_watched(self, index: int) -> subprocess.Popen[bytes]:
        """A worker writing to serve's own stderr (each line names it, `worker-N`), whose exit
        stops serve: a serve that cannot run its model must not answer 503 and hang its
        callers. Its one-line reason for failing comes through a file, not its stderr."""
        assert self.metrics_dir is not None
        failure = self.metrics_dir / f"worker-{index}.failure"
        env = {**(self._worker_env or {}), LOG_NAME_ENV: f"worker-{index}"}
        env[FAILURE_FILE_ENV] = str(failure)
        proc = spawn_tied(self._worker_command(), signal.SIGTERM, env=env)
        threading.Thread(
            target=self._watch, args=(proc, index, failure), name=f"worker-{index}", daemon=True
        ).start()
        return proc

    def _watch(self, proc: subprocess.Popen[bytes], index: int, failure: Path) -> None:
        code = proc.wait()
        if self._stopping:
            return
        reason = ""
        with contextlib.suppress(OSError):
            reason = failure.read_text(encoding="utf-8").strip()
        self.failure = f"worker {index} exited (code {code}): {reason or 'see its output above'}"
        os.kill(os.getpid(), signal.SIGTERM)

    def _start_supervisor(self, config: AutoscaleConfig) -> None:
        ready = threading.Event()

        async def supervise() -> None:
            from tokenyard.broker import connect
            from tokenyard.fleet.supervisor import AutoscaleMetrics, LocalFleet, Supervisor

            stop = asyncio.Event()
            self._supervisor_stop = (asyncio.get_running_loop(), stop)
            ready.set()
            broker = connect(self.broker_settings)
            fleet = LocalFleet(
                self._worker_command, self.drain_timeout_s, procs=self.workers, env=self._worker_env
            )
            metrics = AutoscaleMetrics(self.registry)
            try:
                lanes = self.served_names[0] if self.served_names else self.model
                await Supervisor(broker, lanes, config, fleet=fleet, metrics=metrics).run(stop)
            finally:
                await broker.close()

        self._supervisor = threading.Thread(
            target=asyncio.run, args=(supervise(),), name="autoscale", daemon=True
        )
        self._supervisor.start()
        ready.wait(10)

    def _stop_supervisor(self) -> None:
        if self._supervisor is None:
            return
        if self._supervisor_stop is not None:
            loop, stop = self._supervisor_stop
            loop.call_soon_threadsafe(stop.set)
        self._supervisor.join(30)
        self._supervisor = None

    def _worker_command(self) -> list[str]:
        cmd = tokenyard_command(
            "worker",
            "--broker", self.broker_url, "--prefix", self.prefix,
            "--model", self.model, "--engine", self.engine,
            "--drain-timeout-s", str(self.drain_timeout_s),
            "--log-format", self.log_format, "--log-level", self.log_level,
        )  # fmt: skip
        for name in self.served_names:
            cmd += ["--served-model-name", name]
        if self.tables_url:
            cmd += ["--tables", self.tables_url]
        if self.max_seqs:
            cmd += ["--max-seqs", str(self.max_seqs)]
        audit_kafka = self.given.audit_kafka
        if audit_kafka:  # the workers read the rest of it from the environment they inherit
            cmd += ["--audit-kafka", audit_kafka]
        return cmd

    def stop(self) -> None:
        self._stopping = True  # the workers' exits from here on are serve's own doing
        self._stop_supervisor()  # first, so it starts nothing while the workers drain
        stop_processes(self.workers, self.drain_timeout_s + 15)  # SIGTERM: they drain
        self.workers.clear()
        if self.metrics_dir is not None:
            shutil.rmtree(self.metrics_dir, ignore_errors=True)
            self.metrics_dir = None
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self.tables_server is not None:
            self.tables_server.stop()
            self.tables_server = None

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
