"""The environment the suite runs in is the lock's (requirements/*.lock, made by scripts/lock.sh),
so a test result does not depend on what the registry served the day the venv was made."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOCKS = sorted((ROOT / "requirements").glob("*.lock"))
LOCK_FITS = sys.version_info[:2] == (3, 11) and sys.platform == "linux" and platform.machine() == "x86_64"


@pytest.mark.skipif(not LOCK_FITS, reason="the locks are for CPython 3.11 on x86-64 Linux; setup.sh used the ranges")
def test_this_venv_holds_exactly_the_lock():
    locks = [ROOT / "requirements" / name for name in ("dev.lock", "models.lock")]
    run = subprocess.run([sys.executable, ROOT / "scripts" / "lock_check.py", *locks], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout


@pytest.mark.parametrize("lock", LOCKS, ids=lambda p: p.name)
def test_every_lock_is_made_by_the_lock_script_and_hashes_every_pin(lock):
    text = lock.read_text()
    assert "#    bash scripts/lock.sh" in text.splitlines()[1], f"{lock.name} was not written by scripts/lock.sh"
    pins = [line for line in text.splitlines() if "==" in line and not line.startswith((" ", "#"))]
    assert pins and all(line.endswith("\\") for line in pins), f"{lock.name} has a pin without a hash"
    # dev.lock and image.lock are resolved from pyproject.toml itself
    assert (ROOT / "requirements" / lock.name.replace(".lock", ".in")).exists() or lock.name in ("dev.lock", "image.lock")


def _pins(lock: Path) -> dict[str, str]:
    lines = [ln for ln in lock.read_text().splitlines() if "==" in ln and not ln.startswith((" ", "#"))]
    return dict(ln.split(" ")[0].split("==") for ln in lines)


def test_the_image_installs_kilns_dependencies_at_the_dev_locks_versions():
    """The Dockerfile installs requirements/image.lock: every runtime dependency, each at the version
    the suite ran on (the dev lock's)."""
    import tomllib

    from packaging.requirements import Requirement

    image, dev = _pins(ROOT / "requirements" / "image.lock"), _pins(ROOT / "requirements" / "dev.lock")
    assert image.items() <= dev.items(), {k: (v, dev.get(k)) for k, v in image.items() if dev.get(k) != v}
    needed = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert {Requirement(r).name.lower() for r in needed} | {"pip", "setuptools", "wheel"} <= image.keys()
