"""`tokenyard serve`: a private Valkey, worker processes and the gateway on one machine."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from types import TracebackType
from typing import Literal, Self

import msgspec
from prometheus_client import CollectorRegistry

from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.children import spawn_tied
from tokenyard.config import BrokerSettings
from tokenyard.fleet.autoscale import AutoscaleConfig
from tokenyard.metrics import add_worker_metrics

log = logging.getLogger(__name__)


class Stack:
    """Starts what `serve` needs in order and stops it in reverse; workers drain on the way out."""

    def __init__(
        self,
        *,
        broker: BrokerSettings | None,
        prefix: str,
        model: str,
        engine: str,
        workers: int,
        max_seqs: int | None,
        data_dir: Path,
        appendfsync: Literal["always", "everysec", "no"],
        drain_timeout_s: float = 30.0,
        autoscale: AutoscaleConfig | None = None,
        log_format: str = "text",
    ) -> None:
        self._external = broker
        self.prefix = prefix
        self.model = model
        self.engine = engine
        self.n_workers = workers
        self.max_seqs = max_seqs
        self.data_dir = data_dir
        self.appendfsync = appendfsync
        self.drain_timeout_s = drain_timeout_s
        self.server: EmbeddedServer | None = None
        self.workers: list[subprocess.Popen[bytes]] = []
        # --workers auto: a supervisor thread sizes `workers`; its gauges join the gateway's
        self.autoscale = autoscale
        self.registry = CollectorRegistry()
        self._supervisor: threading.Thread | None = None
        self._supervisor_stop: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None
        self.log_format = log_format
        # workers write their metrics here (prometheus_client's multiprocess mode); `registry`,
        # which the gateway's /metrics serves, reads them
        self.metrics_dir: Path | None = None
        self._worker_env: dict[str, str] | None = None

    @property
    def broker_url(self) -> str:
        if self._external is not None:
            return self._external.url
        assert self.server is not None, "stack not started"
        return self.server.url

    @property
    def broker_settings(self) -> BrokerSettings:
        base = self._external or BrokerSettings(prefix=self.prefix, appendfsync=self.appendfsync)
        return msgspec.structs.replace(base, url=self.broker_url)

    def start(self) -> None:
        if self._external is None:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            # the data dir is kept: jobs accepted before a restart are still there after it
            self.server = EmbeddedServer(
                self.data_dir, keep_data=True, appendfsync=self.appendfsync
            ).start()
        self.metrics_dir = Path(tempfile.mkdtemp(prefix="tokenyard-metrics-"))
        add_worker_metrics(self.registry, self.metrics_dir)
        self._worker_env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(self.metrics_dir)}
        if self.autoscale is not None:
            self._start_supervisor(self.autoscale)
            return
        for _ in range(self.n_workers):
            self.workers.append(
                spawn_tied(self._worker_command(), signal.SIGTERM, env=self._worker_env)
            )

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
                await Supervisor(broker, self.model, config, fleet=fleet, metrics=metrics).run(stop)
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
        cmd = [
            sys.executable, "-m", "tokenyard", "worker",
            "--broker", self.broker_url, "--prefix", self.prefix,
            "--model", self.model, "--engine", self.engine,
            "--drain-timeout-s", str(self.drain_timeout_s),
            "--log-format", self.log_format,
        ]  # fmt: skip
        if self.max_seqs:
            cmd += ["--max-seqs", str(self.max_seqs)]
        return cmd

    def stop(self) -> None:
        self._stop_supervisor()  # first, so it starts nothing while the workers drain
        for proc in self.workers:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.workers:
            try:
                proc.wait(self.drain_timeout_s + 15)
            except subprocess.TimeoutExpired:
                log.warning("worker %d did not drain in time; killing it", proc.pid)
                proc.kill()
                proc.wait()
        self.workers.clear()
        if self.metrics_dir is not None:
            shutil.rmtree(self.metrics_dir, ignore_errors=True)
            self.metrics_dir = None
        if self.server is not None:
            self.server.stop()
            self.server = None

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
