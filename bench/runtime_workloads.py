"""bench_runtime.py's workloads: sizes, prompts (token ids of real text) and the round-robin timer."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from peers import Run

from kiln.tokenizer import Tokenizer

TEXT = Path(__file__).parent.parent / "tests" / "data" / "perplexity.txt"


@dataclass(frozen=True)
class Sizes:
    decode_tokens: int            # new tokens per single-stream run
    batch_tokens: int             # new tokens per request in the 32-stream run
    reps: int                     # timed repetitions after one warm-up; the median is reported
    single_prompt: int = 32
    batch: int = 32
    batch_prompt: int = 64        # equal lengths: the peer's static batch then needs no padding
    ttft_prompt: int = 512


SIZES = {"full": Sizes(decode_tokens=128, batch_tokens=128, reps=3),
         "quick": Sizes(decode_tokens=16, batch_tokens=8, reps=1)}


def make_prompts(tokenizer: Tokenizer, s: Sizes) -> dict[str, list[list[int]]]:
    """Token ids of real text; the 32 batch prompts are consecutive, non-overlapping windows."""
    ids = tokenizer.encode(TEXT.read_text())
    need = max(s.batch * s.batch_prompt, s.ttft_prompt)
    if len(ids) < need:
        raise ValueError(f"{TEXT} has {len(ids)} tokens; the workloads need {need}")
    return {"single": [ids[:s.single_prompt]],
            "batch": [ids[i * s.batch_prompt:(i + 1) * s.batch_prompt] for i in range(s.batch)],
            "ttft": [ids[:s.ttft_prompt]]}


def measure(runners: list, prompts: list[list[int]], n: int, reps: int, progress, label: str) -> dict:
    """One warm-up each (allocations, shapes, weight prepacking), then `reps` rounds round-robin.

    NOTE: the order rotates each round, so load that drifts on a shared machine hits all alike.
    """
    task = progress.add_task(label, total=len(runners) * (reps + 1))
    runs: dict[str, list[Run]] = {r.name: [] for r in runners}
    for r in runners:
        progress.update(task, description=f"{label}: {r.name} warm-up")
        r.generate(prompts, n)
        progress.advance(task)
    for rep in range(reps):
        k = rep % len(runners)
        for r in runners[k:] + runners[:k]:
            progress.update(task, description=f"{label}: {r.name} ({rep + 1}/{reps})")
            runs[r.name].append(r.generate(prompts, n))
            progress.advance(task)
    return runs


def median(runs: list[Run], metric) -> float:
    return statistics.median(metric(r) for r in runs)
