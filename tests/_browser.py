"""Headless Chromium, as the tests that look at the cluster page run it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"


def chromium(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Chromium on ``args`` with a profile in ``tmp``; fails the test if it is not installed."""
    if shutil.which(CHROMIUM) is None:
        pytest.fail(f"{CHROMIUM} is missing: `make browser` installs it (apt-get install chromium)")
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--hide-scrollbars",
        f"--user-data-dir={tmp}",
        "--virtual-time-budget=4000",  # the page's first refreshes, in virtual time
    ]
    return subprocess.run(
        [CHROMIUM, *flags, *args], capture_output=True, text=True, timeout=90, check=True
    )
