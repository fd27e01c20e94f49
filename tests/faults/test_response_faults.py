"""A background response read as a resumed event stream while its gateway and its worker are
killed for real (SIGKILL) mid-generation: one text, no gap and no repeat, on every backend kind."""

from __future__ import annotations

import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from openai.types.responses import ResponseStreamEvent

from tests.conftest import kinds, session_urls
from tokenyard.fleet.launch import Launcher, Processes, free_port, wait_ready

pytestmark = [pytest.mark.fault, pytest.mark.slow]

MODEL = "sim-resp"
TOKENS = 120  # at the sim engine's 10 ms a step: over a second of generation to kill into


class Procs:
    """Real gateway and worker processes on one broker; everything is killed at the end."""

    def __init__(self, url: str, tables_url: str, logs: Path) -> None:
        self.processes = Processes(logs)
        self.launcher = Launcher(self.processes, url, f"rf{uuid.uuid4().hex[:8]}", tables_url)

    def start(
        self, n: int
    ) -> tuple[subprocess.Popen[bytes], subprocess.Popen[bytes], openai.OpenAI]:
        """Gateway and worker number `n`, started side by side; the gateway is up on return."""
        port = free_port()
        worker = self.launcher.worker(
            "--model", MODEL, "--engine", "sim", "--lease-s", "1.0", name=f"worker-{n}"
        )  # fmt: skip
        gateway = self.launcher.gateway(
            port, "--model", MODEL, "--engine", "sim", name=f"gateway-{n}"
        )
        wait_ready(f"http://127.0.0.1:{port}/readyz", gateway, timeout_s=30)
        url = f"http://127.0.0.1:{port}/v1"
        return gateway, worker, openai.OpenAI(base_url=url, api_key="x", max_retries=0)


@pytest.fixture(params=kinds())
def procs(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Procs]:
    pool = Procs(*session_urls(request, request.param), tmp_path / "logs")
    try:
        yield pool
    finally:
        pool.processes.stop(timeout_s=10, sig=signal.SIGKILL)


def _deltas(stream: Iterator[ResponseStreamEvent], into: list[ResponseStreamEvent], n: int) -> None:
    """Read `stream` into `into` until `n` more text deltas came (or it ended)."""
    seen = 0
    for event in stream:
        into.append(event)
        if event.type == "response.output_text.delta":
            seen += 1
            if seen == n:
                return


def _kill(*procs: subprocess.Popen[bytes]) -> None:
    for proc in procs:
        proc.send_signal(signal.SIGKILL)
    for proc in procs:
        proc.wait(10)


def test_resumed_stream_survives_gateway_and_worker_kills(procs: Procs) -> None:
    gateway, worker, c = procs.start(1)
    request = {"model": MODEL, "input": "The yard", "max_output_tokens": TOKENS, "temperature": 0}
    reference = c.responses.create(**request)  # type: ignore[call-overload]
    assert reference.status == "incomplete" and len(reference.output_text) == TOKENS

    response = c.responses.create(**request, background=True)  # type: ignore[call-overload]
    events: list[ResponseStreamEvent] = []
    _deltas(c.responses.retrieve(response.id, stream=True), events, 20)
    assert events[-1].type == "response.output_text.delta"
    assert c.responses.retrieve(response.id).status == "in_progress"
    _kill(gateway, worker)  # mid-generation: the first read is gone, and so is the job's worker

    _, _, c = procs.start(2)
    resumed = c.responses.retrieve(
        response.id, stream=True, starting_after=events[-1].sequence_number
    )
    events.extend(resumed)

    assert [e.sequence_number for e in events] == list(range(len(events)))  # no gap, no repeat
    assert events[-1].type == "response.incomplete"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == reference.output_text
    done = c.responses.retrieve(response.id)  # the new gateway stored what it saw
    assert done.status == "incomplete" and done.output_text == reference.output_text
