"""Headless Chromium for the Playground's browser test and screenshots: Debian's `chromium` driven by Playwright.

Owns: finding the browser (no browser is ever downloaded: `playwright install` is not used, the system's Chromium
is) and the flags that keep it offline and quiet. Does not own: what is done with the page (tests/test_playground.py,
tools.playground_screenshots).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

CHROMIUM_PATHS = ("/usr/bin/chromium", "/usr/bin/chromium-browser")
FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
MISSING = ("Chromium is not installed: the Playground's browser test needs Debian's chromium package "
           "(apt-get install -y chromium) and the playwright Python package (pip install -e '.[test]')")


def chromium_path() -> str | None:
    """The system Chromium, or None."""
    for path in CHROMIUM_PATHS:
        if shutil.which(path):
            return path
    return shutil.which("chromium")


@contextmanager
def chromium() -> Iterator[Any]:
    """A running headless Chromium (a Playwright Browser); raises RuntimeError saying what to install if it cannot."""
    path = chromium_path()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        raise RuntimeError(MISSING) from None
    if path is None:
        raise RuntimeError(MISSING)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=path, headless=True, args=FLAGS)
        try:
            yield browser
        finally:
            browser.close()
