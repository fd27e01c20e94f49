"""Fixtures of the integration tests that start tokenyard's own processes."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest

from tokenyard.fleet.launch import Processes


@pytest.fixture
def procs() -> Iterator[Processes]:
    """The test's child processes (their output joins the test's captured output), killed at
    its end."""
    started = Processes()
    yield started
    started.stop(timeout_s=30, sig=signal.SIGKILL)
