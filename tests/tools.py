"""Debian programs some tests drive (Chromium and its driver, Prometheus and promtool; `make
test-tools`, as root). Without one a test skips, unless TOKENYARD_REQUIRE_TOOLS=1 (CI): then it
fails, so a machine that lost a tool cannot pass by skipping."""

from __future__ import annotations

import os
import shutil

import pytest

REQUIRE = "TOKENYARD_REQUIRE_TOOLS"


def tools(*names: str, package: str) -> list[str]:
    """The paths of the programs `names` (Debian `package`); skip or fail when one is missing."""
    found = [shutil.which(name) for name in names]
    missing = [name for name, path in zip(names, found, strict=True) if path is None]
    if missing:
        why = f"{', '.join(missing)} not installed (Debian {package}: make test-tools, as root)"
        if os.environ.get(REQUIRE) == "1":
            pytest.fail(f"{why}; {REQUIRE}=1 needs it")
        pytest.skip(why)
    return [path for path in found if path is not None]
