"""Polling for a condition another thread or process makes true, with a bound."""

from __future__ import annotations

import time


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.01) -> None:
    """Returns once predicate() is true; fails the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s"
        time.sleep(interval)
