"""A command that needs a broker and was given none, with no serve running here, says so in one
line and fails; nothing is stored anywhere (there is no in-process broker to fall back on)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tokenyard.fleet.local import LocalServe, record

REPO = Path(__file__).resolve().parents[2]

NEEDS_A_BROKER = [
    ("keys", "create", "--tenant", "acme"),
    ("keys", "list"),
    ("tenants", "show"),
    ("status",),
    ("audit", "--since", "1h"),
    ("autoscale", "--port", "0"),
    ("gateway",),
    ("worker", "--engine", "sim"),
    ("worker-ready",),
]


@pytest.mark.timeout(120)
def test_commands_given_no_broker_fail_in_one_line(tmp_path: Path) -> None:
    # no broker anywhere: not in the environment, not in a config file
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENYARD_")}
    # and no serve: the record a killed one left behind names a process that is gone
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], text=True,
                          capture_output=True, check=True)  # fmt: skip
    stale = LocalServe(
        pid=int(gone.stdout), started_at=0.0, broker_url="redis://127.0.0.1:1/0",
        api_url="http://127.0.0.1:1", model="tiny", engine="sim", workers="1",
    )  # fmt: skip
    record(tmp_path / ".tokenyard" / "valkey", stale)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tokenyard", *args],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for args in NEEDS_A_BROKER
    ]
    for args, proc in zip(NEEDS_A_BROKER, procs, strict=True):
        out, err = proc.communicate(timeout=60)
        assert proc.returncode not in (0, None), (args, out, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1, (args, err)
        assert "--broker" in lines[0] and "TOKENYARD_BROKER_URL" in lines[0], (args, err)
        assert "Traceback" not in err
        if args[:2] == ("keys", "create"):
            assert out == "", out  # no key printed: none was stored
