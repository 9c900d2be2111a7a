"""Does this Python's environment hold exactly what the lock files name?

    python scripts/lock_check.py requirements/dev.lock requirements/models.lock [--sync]

Compares every installed distribution (what `pip freeze --all` lists, the project's own editable
install aside) with the locks' `name==version` lines. With --sync, distributions the locks do not
name are uninstalled first (a venv reused across lock changes keeps what an older lock brought).
Exits 1, listing each difference, when the environment and the locks still differ. Standard
library only: it runs before anything else is known to be installed.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

PROJECT = "kiln"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([^\s;\\]+)")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def locked(paths: list[Path]) -> dict[str, str]:
    pins: dict[str, str] = {}
    for path in paths:
        for line in path.read_text(encoding="utf-8").splitlines():
            match = PIN.match(line)
            if match:
                pins[canonical(match[1])] = match[2]
    return pins


def installed() -> dict[str, str]:
    found = {canonical(d.metadata["Name"]): d.version for d in metadata.distributions() if d.metadata["Name"]}
    found.pop(PROJECT, None)
    return found


def differences(pins: dict[str, str], have: dict[str, str]) -> list[str]:
    lines = [f"missing: {name}=={version}" for name, version in sorted(pins.items()) if name not in have]
    lines += [f"not in the lock: {name}=={version}" for name, version in sorted(have.items()) if name not in pins]
    lines += [f"{name}: installed {have[name]}, locked {version}" for name, version in sorted(pins.items())
              if name in have and have[name] != version]
    return lines


def uninstall_unlocked(pins: dict[str, str]) -> None:
    extra = sorted(set(installed()) - set(pins))
    if extra:
        print(f"removing {len(extra)} package(s) the lock does not name: {' '.join(extra)}")
        subprocess.run([sys.executable, "-m", "pip", "uninstall", "-q", "-y", *extra], check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("locks", nargs="+", type=Path)
    parser.add_argument("--sync", action="store_true", help="uninstall what the locks do not name first")
    args = parser.parse_args()
    pins = locked(args.locks)
    if args.sync:
        uninstall_unlocked(pins)
    lines = differences(pins, installed())
    for line in lines:
        print(line)
    if lines:
        print(f"{sys.prefix} differs from {' '.join(map(str, args.locks))}: run bash scripts/setup.sh")
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())
