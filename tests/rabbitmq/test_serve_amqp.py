"""`tokenyard serve --broker amqp://... --model tiny` end to end: RabbitMQ lanes, their tables
on the private Valkey serve starts (no --tables given), a worker on the tiny Llama and the
gateway, answering the official openai client. The requests are the NATS serve test's."""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator

import pytest

from tests.integration.test_serve_nats import (
    MODEL,
    Served,
    children_running,
    test_a_small_batch_through_files_and_batches,
    test_job_events_resume_from_last_event_id,
    test_streamed_chat_equals_the_whole_answer,
    test_sync_completion,
)
from tests.rabbitmq_server import RabbitServer
from tests.servers import alive
from tokenyard.fleet.launch import Processes, free_port, tokenyard_command, wait_ready

pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow, pytest.mark.rabbitmq]

__all__ = [
    "test_a_small_batch_through_files_and_batches",
    "test_job_events_resume_from_last_event_id",
    "test_streamed_chat_equals_the_whole_answer",
    "test_sync_completion",
]


@pytest.fixture(scope="module")
def served(rabbitmq: RabbitServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("serve-amqp")
    port = free_port()
    # nothing from the environment picks the broker or the tables
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENYARD_")}
    env["TOKENYARD_GATEWAY_FILES_DIR"] = str(tmp / "files")
    procs = Processes()
    serve = procs.start(
        "serve",
        tokenyard_command(
            "serve", "--broker", rabbitmq.url, "--prefix", f"s{uuid.uuid4().hex[:8]}",
            "--model", MODEL, "--port", str(port), "--max-seqs", "8",
            "--data-dir", str(tmp / "tables"),
        ),
        env=env,
        cwd=tmp,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url + "/readyz", procs, timeout_s=180, interval_s=0.5)
        tables = children_running(serve.pid, "valkey-server")
        assert len(tables) == 1, "serve runs one private Valkey for the lanes' tables"
        yield Served(url, tmp / "tables", procs)
        # SIGINT: the workers drain, then the Valkey stops, then serve exits cleanly
        serve.send_signal(signal.SIGINT)
        assert serve.wait(120) == 0
        assert not {pid for pid in tables if alive(pid)}, "the tables' Valkey left running"
    finally:
        procs.stop(timeout_s=30, sig=signal.SIGKILL)
