"""The image's install steps (deploy/docker/install.sh) in a fresh venv, from the build
context the Dockerfile sees: torch, then tokenyard with the hf extra, not editable. The
installed `tokenyard` then runs a gateway and a sim worker, configured by environment as the
Helm chart configures them, and answers a completion. Minutes (a torch install):
`make test-deploy`, not `make test`."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.deploy.dockerfile import ROOT, build_context
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.fleet.launch import Processes, free_port, wait_ready

# a torch install takes minutes, more than the suite's per-test limit
pytestmark = [pytest.mark.install, pytest.mark.timeout(1800)]


def test_install_steps_give_a_working_tokenyard(tmp_path: Path, valkey: EmbeddedServer) -> None:
    context = build_context(tmp_path / "context")
    venv = tmp_path / "venv"
    # nothing of this checkout may leak in: no PYTHONPATH, no venv of ours on PATH
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(
        VENV=str(venv),
        SRC=str(context),
        EXTRAS="hf",
        # empty: pip's default index (here the CPU build on disk); the CPU image sets the
        # CPU-only index, which `make test-deploy TORCH_INDEX=...` can name too
        TORCH_INDEX=os.environ.get("TORCH_INDEX", ""),
        PATH="/usr/local/bin:/usr/bin:/bin",
    )
    subprocess.run(
        ["sh", str(ROOT / "deploy" / "docker" / "install.sh")],
        env=env,
        cwd=tmp_path,
        check=True,
        timeout=1500,
    )
    python = venv / "bin" / "python"
    where = subprocess.run(
        [str(python), "-c", "import tokenyard, torch; print(tokenyard.__file__)"],
        env=env,
        cwd=tmp_path,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    assert where.startswith(str(venv)), where  # installed, not this checkout

    port = free_port()
    role_env = {
        **env,
        "TOKENYARD_BROKER_URL": valkey.url,
        "TOKENYARD_BROKER_PREFIX": f"install-{port}",
        "TOKENYARD_GATEWAY_MODELS": "tiny",
        "TOKENYARD_GATEWAY_PORT": str(port),
        "TOKENYARD_WORKER_MODEL": "tiny",
        "TOKENYARD_WORKER_ENGINE": "sim",
    }
    tokenyard = str(venv / "bin" / "tokenyard")
    with Processes(tmp_path / "logs") as procs:
        procs.start("gateway", [tokenyard, "gateway"], env=role_env, cwd=tmp_path)
        procs.start("worker", [tokenyard, "worker"], env=role_env, cwd=tmp_path)
        wait_ready(f"http://127.0.0.1:{port}/readyz", procs, timeout_s=120)
        reply = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": "tiny", "prompt": "The yard", "max_tokens": 4},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 4
