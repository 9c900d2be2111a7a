"""A live line per level while it runs: elapsed time against the duration, requests done, errors."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from kiln.bench.loadgen import Level
from kiln.bench.records import Outcome, RequestRecord


class NullProgress:
    def start(self, level: Level, duration: float) -> None:
        pass

    def tick(self, elapsed: float) -> None:
        pass

    def record(self, record: RequestRecord) -> None:
        pass

    def finish(self) -> None:
        pass

    def close(self) -> None:
        pass


class RichProgress(NullProgress):
    def __init__(self, console: Console):
        self.progress = Progress(TextColumn("{task.description:>12}"), BarColumn(), TimeElapsedColumn(),
                                 TextColumn("{task.fields[done]} done · {task.fields[failed]} failed · "
                                            "{task.fields[tokens]} tokens"),
                                 console=console, transient=False)
        self.progress.start()
        self.task = None

    def start(self, level: Level, duration: float) -> None:
        self.duration, self.counts = duration, dict(done=0, failed=0, tokens=0)
        self.task = self.progress.add_task(level.label, total=duration, **self.counts)

    def tick(self, elapsed: float) -> None:
        self.progress.update(self.task, completed=min(elapsed, self.duration))

    def record(self, record: RequestRecord) -> None:
        self.counts["done"] += 1
        self.counts["failed"] += record.outcome in (Outcome.ERROR, Outcome.TIMEOUT)
        self.counts["tokens"] += record.output_tokens
        self.progress.update(self.task, **self.counts)

    def finish(self) -> None:
        self.progress.update(self.task, completed=self.duration)

    def close(self) -> None:
        self.progress.stop()
