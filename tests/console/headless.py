"""Headless Chromium driven by selenium, for the console's browser tests and
scripts/console_screenshots.py. Needs the dev extra (selenium) and Debian's chromium and
chromium-driver (scripts/setup.sh installs them)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
# NOTE: the machines reach no network: without these flags Chromium stalls on its background
# fetches (component updates, sync, QUIC probes) and the first page load times out.
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage")


def missing() -> str | None:
    """Why a browser cannot start here, or None."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[dev]')"
    for path in (CHROMIUM, CHROMEDRIVER):
        if not Path(path).exists():
            return f"{path} is missing (scripts/setup.sh installs chromium and chromium-driver)"
    return None


class Browser:
    """A Chromium with a fresh profile; close() quits it and removes the profile."""

    def __init__(self, width: int = 1280, height: int = 900):
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        self.profile = tempfile.mkdtemp(prefix="kiln-chromium-")
        options = webdriver.ChromeOptions()
        options.binary_location = CHROMIUM
        for flag in (*FLAGS, f"--user-data-dir={self.profile}", f"--window-size={width},{height}"):
            options.add_argument(flag)
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})    # script errors, for tests
        # An explicit driver path: selenium would otherwise try to download one.
        self.driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)

    def script_errors(self) -> list[str]:
        """Uncaught errors and unhandled rejections in the page's scripts since the last call
        (failed requests, a 401 say, are the network's entries and not counted)."""
        return [e["message"] for e in self.driver.get_log("browser") if e.get("source") == "javascript"]

    def close(self) -> None:
        try:
            self.driver.quit()
        finally:
            shutil.rmtree(self.profile, ignore_errors=True)
