"""Every entry point under bench/ starts: `python -m bench.NAME --help` from the repository root
exits 0 with its usage, and bench/README.md's table has a row for it (and for each setup_*.sh), so a
script added without a README line, or one whose imports broke, fails here. Nothing is measured."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"


def _runs_as_main(path: Path) -> bool:
    """Whether the module has an `if __name__ == "__main__":` block."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and isinstance(test := node.test, ast.Compare) \
                and isinstance(test.left, ast.Name) and test.left.id == "__name__" \
                and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in test.comparators):
            return True
    return False


ENTRY_POINTS = sorted(p.stem for p in BENCH.glob("*.py") if _runs_as_main(p))
SETUP_SCRIPTS = sorted(p.name for p in BENCH.glob("setup_*.sh"))


def test_the_entry_points_are_found():
    assert {"bench_runtime", "bench_serving", "render_results"} <= set(ENTRY_POINTS)
    assert "setup_peers.sh" in SETUP_SCRIPTS


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_help_runs_from_the_repository_root(module):
    run = subprocess.run([sys.executable, "-m", f"bench.{module}", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.startswith("usage:"), run.stdout[:500]


def test_the_readme_has_a_row_for_every_entry_point_and_setup_script():
    rows = set(re.findall(r"^\| `([\w.]+)` \|", (BENCH / "README.md").read_text(), flags=re.M))
    missing = sorted((set(ENTRY_POINTS) | set(SETUP_SCRIPTS)) - rows)
    assert not missing, f"bench/README.md's entry-point table has no row for {missing}"
