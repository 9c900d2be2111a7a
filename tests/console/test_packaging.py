"""The console's static files ship in the distribution: pyproject's package-data covers each one."""

from __future__ import annotations

import tomllib
from pathlib import Path

import kiln

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = Path(kiln.__file__).parent
STATIC = PACKAGE / "serving" / "console" / "static"


def test_package_data_covers_every_static_file():
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["kiln"]
    shipped = {path for pattern in globs for path in PACKAGE.glob(pattern)}     # setuptools globs the same way
    files = {path for path in STATIC.rglob("*") if path.is_file()}
    assert {STATIC / "index.html", STATIC / "console.js"} <= files
    assert not files - shipped, f"not in [tool.setuptools.package-data]: {sorted(files - shipped)}"
