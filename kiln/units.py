"""Human byte sizes: '4GiB', '512MB', '1.5G' <-> bytes."""

from __future__ import annotations

import re

_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_bytes(text: str | int) -> int:
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([\d.]+)\s*([kmgt]i?)?b?\s*", text.lower())
    if not m:
        raise ValueError(f"cannot read {text!r} as a size; write e.g. 512MiB or 4GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
