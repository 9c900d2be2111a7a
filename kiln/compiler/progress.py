"""How a build shows its stages on a terminal: a spinner per stage, then a tick with its time."""

from __future__ import annotations

import time
from contextlib import contextmanager

from rich.console import Console

console = Console(stderr=True, soft_wrap=True)


@contextmanager
def rich_stage(name: str):
    t0 = time.perf_counter()
    with console.status(f"{name} …"):
        yield
    console.print(f"  [green]✓[/] {name} [dim]({time.perf_counter() - t0:.1f} s)[/]")
