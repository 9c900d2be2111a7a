"""The console every bench_runtime.py module prints to."""

import sys

from rich.console import Console

# NOTE: rich falls back to 80 columns when stdout is a file or pipe; the tables need more.
console = Console(width=None if sys.stdout.isatty() else 132)
