"""Headless Chromium for the dashboard's tests (Debian `chromium` and `chromium-driver`, see
tests/tools.py). Screenshots go to $TOKENYARD_TEST_ARTEFACTS when set, else the test's
tmp_path."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from tests.tools import tools

if TYPE_CHECKING:
    from selenium.webdriver.remote.webdriver import WebDriver

ARTEFACTS = "TOKENYARD_TEST_ARTEFACTS"
# as root in a container: no sandbox; nothing fetched behind the test's back
FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1400,1000",
)


@contextlib.contextmanager
def chromium(profile: Path) -> Iterator[WebDriver]:
    """A headless Chromium with a fresh profile in `profile`, quit on exit."""
    binary, driver = tools("chromium", "chromedriver", package="chromium chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in (*FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    browser = webdriver.Chrome(service=Service(driver), options=options)
    try:
        yield browser
    finally:
        browser.quit()


def artefacts(tmp_path: Path) -> Path:
    """Where a test keeps what a person should see (screenshots); printed, so -s shows it."""
    where = Path(os.environ.get(ARTEFACTS) or tmp_path)
    where.mkdir(parents=True, exist_ok=True)
    return where


def screenshot(browser: WebDriver, where: Path, name: str) -> Path:
    shot = where / name
    assert browser.save_screenshot(str(shot)), shot
    assert shot.stat().st_size > 1000
    print(f"screenshot: {shot}")
    return shot
