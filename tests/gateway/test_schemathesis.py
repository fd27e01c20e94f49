"""Schemathesis fuzzes every operation of the gateway's OpenAPI with every check: the document
says what the server does (bodies, statuses, content types, Allow), no 5xx, no traceback.

The examples, fuzzing and stateful phases run here (a few examples per operation, ~30 s on a
busy host); the coverage phase (~1,700 boundary cases, minutes) is worth a run by hand after a
change to a route or `gateway/openapi.py`:
`schemathesis --config-file tests/gateway/schemathesis.toml run URL/openapi.json --checks all
--phases coverage`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gateway.conftest import run_stack
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.engines.base import Engine
from tokenyard.engines.sim import SimEngine

pytestmark = pytest.mark.slow

SCHEMATHESIS = Path(sys.executable).with_name("schemathesis")
CONFIG = Path(__file__).with_name("schemathesis.toml")


def _instant_engine() -> Engine:
    return SimEngine(
        prefill_base=0.0, prefill_per_token=0.0, decode_base=0.0005, decode_per_seq=0.0
    )


def test_the_openapi_document_says_what_the_server_does(
    valkey: EmbeddedServer, tmp_path: Path
) -> None:
    if not SCHEMATHESIS.exists():
        pytest.skip("schemathesis is not installed (the dev extra)")
    har = tmp_path / "exchanges.har"
    # a small max_tokens cap (the document says it) keeps the accepted requests' jobs short
    with run_stack(
        valkey,
        engines=[_instant_engine],
        files_dir=str(tmp_path / "files"),
        max_tokens_cap=16,
        default_max_tokens=16,
    ) as stack:
        run = subprocess.run(
            [str(SCHEMATHESIS), "--config-file", str(CONFIG), "run", f"{stack.url}/openapi.json",
             "--checks", "all", "--phases", "examples,fuzzing,stateful",
             "--max-examples", "8", "--seed", "1",
             "--report", "har", "--report-har-path", str(har)],
            capture_output=True, text=True, timeout=240, cwd=tmp_path,  # its cache goes there
        )  # fmt: skip
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    entries = json.loads(har.read_text())["log"]["entries"]
    assert len(entries) > 100
    paths = {e["request"]["url"].split("?")[0].removeprefix(stack.url) for e in entries}
    assert {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/jobs",
        "/v1/messages",
        "/dashboard/data",
        "/tokenize",
        "/detokenize",
        "/version",
    } <= paths
    accepted = [e for e in entries if e["response"]["status"] == 200]
    for path in ("/v1/completions", "/v1/messages", "/tokenize"):
        assert any(e["request"]["url"].endswith(path) for e in accepted), path
    for entry in entries:
        response = entry["response"]
        assert response["status"] < 500, entry
        assert "Traceback" not in response["content"].get("text", ""), entry
