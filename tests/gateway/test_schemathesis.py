"""Schemathesis fuzzes every operation of the gateway's OpenAPI: no 5xx, no traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gateway.conftest import Stack

pytestmark = pytest.mark.slow

SCHEMATHESIS = Path(sys.executable).with_name("schemathesis")


def test_fuzzed_requests_get_no_server_error_and_no_traceback(stack: Stack, tmp_path: Path) -> None:
    if not SCHEMATHESIS.exists():
        pytest.skip("schemathesis is not installed (the dev extra)")
    har = tmp_path / "exchanges.har"
    run = subprocess.run(
        [str(SCHEMATHESIS), "run", f"{stack.url}/openapi.json",
         "--checks", "not_a_server_error", "--max-examples", "10", "--seed", "1",
         "--report", "har", "--report-har-path", str(har)],
        capture_output=True, text=True, timeout=240, cwd=tmp_path,  # its cache goes there
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    entries = json.loads(har.read_text())["log"]["entries"]
    assert len(entries) > 100
    paths = {e["request"]["url"].split("?")[0].removeprefix(stack.url) for e in entries}
    assert {"/v1/completions", "/v1/chat/completions", "/v1/jobs", "/dashboard/data"} <= paths
    for entry in entries:
        response = entry["response"]
        assert response["status"] < 500, entry
        assert "Traceback" not in response["content"].get("text", ""), entry
