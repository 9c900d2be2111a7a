"""Where the third-party clients live: .venv-clients, a venv of their own that
`scripts/setup.sh --clients` builds (scripts/test.sh runs it; they need numpy >= 2, kiln's
environment pins numpy < 2)."""

from __future__ import annotations

from pathlib import Path

import pytest

CLIENTS_VENV = Path(__file__).resolve().parents[2] / ".venv-clients"


def client_tool(name: str) -> Path:
    """The console script `name` of the clients' venv; the test fails (not skips) without it."""
    path = CLIENTS_VENV / "bin" / name
    if not path.is_file():
        pytest.fail(f"{name} is not installed in {CLIENTS_VENV}: run bash scripts/setup.sh --clients "
                    f"(it installs requirements/clients.lock there)")
    return path


def counter_delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    """How much a Prometheus counter (or a histogram's _sum/_count) grew between two scrapes."""
    return after.get(name, 0.0) - before.get(name, 0.0)
