"""kiln's in-process engine side by side with its peers (HF transformers; onnxruntime-genai where
installed and given a model) on the same weights, the same requests (the same token ids: every
peer takes kiln's tokenization) and the same threads, in one run.

Levels alternate between the systems (kiln at level 1, each peer at level 1, kiln at level 2 ...),
so load that drifts on a shared machine hits all alike. Ratios are printed so that above 1 favours kiln.

    kiln bench --engine engines/smollm2-fp32 --compare --hf-model smollm2-135m --concurrency 1,4
    kiln bench --engine bench/.cache/kiln-fp32 --compare --genai-model bench/.cache/genai-fp32
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import replace
from pathlib import Path

from rich.table import Table

from kiln.bench.progress import NullProgress
from kiln.bench.session import BenchConfig, BenchResult, run_bench
from kiln.bench.stats import LevelStats
from kiln.bench.target_engine import EngineTarget

# (column, stat getter, True when larger is better for kiln)
RATIOS = [
    ("out tok/s", lambda s: s.output_tokens_per_s, True),
    ("req/s", lambda s: s.requests_per_s, True),
    ("TTFT p50", lambda s: s.ttft.p50, False),
    ("TTFT p99", lambda s: s.ttft.p99, False),
    ("ITL p50", lambda s: s.itl.p50, False),
    ("e2e p50", lambda s: s.e2e.p50, False),
]


def kiln_ids(kiln: EngineTarget):
    """Prompt -> kiln's token ids, which every peer is given, so all run the very same tokens."""
    llm = kiln.llm

    def to_ids(prompt):
        return llm.chat_prompt(prompt.as_messages()) if kiln.endpoint == "chat" else llm.tokenizer.encode(prompt.as_text())
    return to_ids


def load_peers(kiln: EngineTarget, hf_source: str | None, genai_dir: Path | None, threads: int) -> list:
    peers = []
    if hf_source:
        from kiln.bench.target_hf import HFTarget, load_hf_model

        peers.append(HFTarget(load_hf_model(hf_source), kiln_ids(kiln), kiln.context_len, kiln.temperature, threads))
    if genai_dir:
        from kiln.bench.target_genai import GenAITarget

        peers.append(GenAITarget(genai_dir, kiln_ids(kiln), kiln.context_len, kiln.temperature, threads))
    if not peers:
        raise ValueError("--compare needs a peer: --hf-model and/or --genai-model")
    return peers


async def compare(targets: list, config: BenchConfig, progress_for=lambda target: NullProgress()) -> list[BenchResult]:
    """Each level on every target in turn; one BenchResult per target, levels in sweep order."""
    # NOTE: kiln's exact counter for everyone: the same prompts, token for token.
    counter = await targets[0].prepare()
    for peer in targets[1:]:
        await peer.prepare()
    results: list[BenchResult | None] = [None] * len(targets)
    for level in config.levels:
        for i, target in enumerate(targets):
            progress = progress_for(target)
            try:
                one = await run_bench(target, counter, replace(config, levels=(level,)), progress)
            finally:
                progress.close()
            results[i] = one if results[i] is None else _merged(results[i], one)
    return results


def _merged(into: BenchResult, more: BenchResult) -> BenchResult:
    into.levels.extend(more.levels)
    into.config = replace(into.config, levels=into.config.levels + more.config.levels)
    return into


def ratio_table(kiln: BenchResult, peer: BenchResult) -> Table:
    t = Table(title=f"kiln vs {peer.target}: ratios (> 1 favours kiln; latency ratios are peer ÷ kiln)")
    t.add_column("level")
    for name, _, _ in RATIOS:
        t.add_column(name, justify="right")
    for mine, theirs in zip(kiln.levels, peer.levels):
        t.add_row(mine.level.label, *(_ratio(mine.stats, theirs.stats, get, up) for _, get, up in RATIOS))
    return t


def ratios_json(kiln: BenchResult, peer: BenchResult) -> list[dict]:
    return [{"level": mine.level.label, "peer": peer.target,
             **{name: _value(mine.stats, theirs.stats, get, up) for name, get, up in RATIOS}}
            for mine, theirs in zip(kiln.levels, peer.levels)]


def _value(mine: LevelStats, theirs: LevelStats, get, larger_is_better: bool) -> float | None:
    a, b = get(mine), get(theirs)
    if not a or not b:
        return None
    return a / b if larger_is_better else b / a


def _ratio(mine: LevelStats, theirs: LevelStats, get, larger_is_better: bool) -> str:
    r = _value(mine, theirs, get, larger_is_better)
    if r is None:
        return "—"
    color = "green" if r >= 1 else "red"
    return f"[{color}]{r:.2f}×[/]"


def default_threads(runtime_threads: int | None) -> int:
    return runtime_threads or len(os.sched_getaffinity(0))


def run_compare(kiln: EngineTarget, hf_source: str | None, genai_dir: Path | None, config: BenchConfig,
                threads: int | None, progress_for=lambda target: NullProgress()) -> list[BenchResult]:
    peers = load_peers(kiln, hf_source, genai_dir, default_threads(threads))

    async def go():
        try:
            return await compare([kiln, *peers], config, progress_for)
        finally:
            await kiln.close()
    return asyncio.run(go())
