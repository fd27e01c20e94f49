"""A command that needs a broker and was given none says so in one line and fails; nothing is
stored anywhere (there is no in-process broker to fall back on)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

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
