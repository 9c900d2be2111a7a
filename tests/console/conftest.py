"""The console's tests: `kiln serve` on the tiny model through the serving tests' fixtures, and one
headless Chromium per module (kiln.serving.console.headless)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from headless import Browser, missing

SERVING = Path(__file__).resolve().parents[1] / "serving"
sys.path.insert(0, str(SERVING))      # serving_flags, which the serving conftest imports by name


def _serving_fixtures():
    """tests/serving/conftest.py under a name of its own (every folder's conftest is `conftest`)."""
    spec = importlib.util.spec_from_file_location("kiln_serving_fixtures", SERVING / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_serving = _serving_fixtures()
start_server, start_module_server, tiny_server = (_serving.start_server, _serving.start_module_server,
                                                  _serving.tiny_server)


@pytest.fixture(scope="module")
def chromium():
    reason = missing()
    if reason is not None:
        pytest.skip(reason)
    b = Browser()
    yield b
    b.close()


@pytest.fixture
def browser(chromium):
    """The module's Chromium for one test, which fails if the page's scripts raised."""
    chromium.script_errors()                 # whatever an earlier test left
    yield chromium.driver
    assert chromium.script_errors() == []
