"""Where kiln's time goes, for the targets it misses: ONNX Runtime's per-op-type profile of kiln's
engine next to onnxruntime-genai's for the same step, and cProfile of kiln's Python step."""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

from peers import GenAIRunner
from rich.table import Table
from runtime_console import console
from runtime_kiln import KilnRunner

HERE = Path(__file__).parent


def profile_misses(cases: list[tuple], kiln: dict, genai: dict, prompts: dict) -> dict:
    out = {}
    for precision, batch, phase in cases:
        key = f"{precision}, B={batch}, {phase}"
        if phase == "python":
            out[key] = profile_python(kiln[precision], prompts["batch"])
            continue
        workload = prompts["batch"] if batch > 1 else prompts["ttft" if phase == "prefill" else "single"]
        with console.status(f"profiling {key}"):
            out[key] = profile_engines(kiln[precision], genai[precision], workload, phase)
        print_ops(key, out[key])
    return out


def profile_engines(kiln: KilnRunner, genai: GenAIRunner, prompts: list[list[int]], phase: str,
                    rounds: int = 3) -> dict[str, dict[str, float]]:
    """ORT's per-op profile of kiln's engine and genai's for the same generate, round-robin.

    Both run profiling sessions side by side, alternating, the first round dropped (warm-up), so
    drifting load hits both alike; each op's figure is its median over engine calls (decode) or
    over generates (prefill: kiln splits a 32-prompt prefill into chunks by its token budget).
    """
    import gc

    n = 1 if phase == "prefill" else 8
    prefix = HERE / ".cache" / f"profile-genai-{time.time_ns()}"
    peer = GenAIRunner(genai.model_dir, genai.threads, "profiled", {"enable_profiling": str(prefix)})
    engine, shapes, starts = _swap_in_profiling(kiln)
    try:
        for _ in range(rounds):
            starts.append(len(shapes))
            kiln.generate(prompts, n)
            peer.generate(prompts, n)
    finally:
        kiln.llm.core.engine = kiln.llm.core.runner.engine = engine.original
    kiln_units = _kiln_units(_model_runs(engine.session.end_profiling()), shapes, starts[1:] + [len(shapes)], phase)
    del peer
    gc.collect()                                       # genai writes its profile when the session goes
    genai_runs = _model_runs(str(max(prefix.parent.glob(prefix.name + "*.json"), key=os.path.getmtime)))
    per_generate = [genai_runs[i:i + n] for i in range(n, len(genai_runs), n)]
    genai_units = [g[0] for g in per_generate] if phase == "prefill" else [r for g in per_generate for r in g[1:]]
    return {"kiln": _median(kiln_units), "onnxruntime-genai": _median(genai_units)}


def _swap_in_profiling(runner: KilnRunner):
    """A copy of kiln's engine on a profiling session, put where the core and the runner call it."""
    import copy

    core = runner.llm.core
    engine = copy.copy(core.engine)
    engine.original = core.engine
    engine.session = _profiling_session(runner.llm.artifact.engine_file("ort"), core.engine.threads)
    shapes, run = [], engine.run
    engine.run = lambda feeds: (shapes.append(feeds["input_ids"].shape), run(feeds))[1]
    core.engine = core.runner.engine = engine
    return engine, shapes, []


def _kiln_units(runs: list[dict], shapes: list[tuple], bounds: list[int], phase: str) -> list[dict]:
    """Per kept generate (between bounds): its prefill calls summed, or each full-batch decode call."""
    units = []
    for lo, hi in zip(bounds, bounds[1:]):
        if phase == "prefill":
            units.append(_sum([runs[i] for i in range(lo, hi) if shapes[i][1] > 1]))
        else:
            batch = max(shapes[i][0] for i in range(lo, hi))
            units += [runs[i] for i in range(lo, hi) if shapes[i] == (batch, 1)]
    return units


def _profiling_session(model_path: Path, threads: int):
    import onnxruntime as ort

    # The options kiln's OrtEngine uses (the artifact is optimized offline), plus profiling.
    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.enable_profiling = True
    opts.profile_file_prefix = str(HERE / ".cache" / "profile-kiln")
    opts.log_severity_level = 3
    return ort.InferenceSession(str(model_path), opts, providers=["CPUExecutionProvider"])


NODES, CALLS = "(nodes run)", "(engine calls)"


def _model_runs(path: str) -> list[dict[str, float]]:
    """Per session.run in an ORT profile: ms by op type, the run's own duration and its node count."""
    import bisect
    from collections import defaultdict

    events = json.loads(Path(path).read_text())
    Path(path).unlink()
    spans = sorted((e["ts"], e["dur"]) for e in events if e.get("name") == "model_run")
    starts = [s for s, _ in spans]
    runs = [defaultdict(float, {"(whole run)": d / 1e3, CALLS: 1}) for _, d in spans]
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            run = runs[bisect.bisect_right(starts, e["ts"]) - 1]
            run[e["args"]["op_name"]] += e["dur"] / 1e3    # profiles count microseconds
            run[NODES] += 1
    return runs


def _between_kernels(ops: dict[str, float]) -> float:
    """The run's time not inside any kernel: ORT's per-node dispatch, allocation, input checks.

    NOTE: approximate where the figures are medians per op (they need not add up exactly)."""
    kernels = sum(v for k, v in ops.items() if not k.startswith("("))
    return ops.get("(whole run)", 0.0) - kernels


def _sum(runs: list[dict[str, float]]) -> dict[str, float]:
    keys = {k for r in runs for k in r}
    return {k: sum(r.get(k, 0.0) for r in runs) for k in keys}


def _median(units: list[dict[str, float]]) -> dict[str, float]:
    keys = {k for u in units for k in u}
    return {k: statistics.median(u.get(k, 0.0) for u in units) for k in keys} if units else {}


def print_ops(key: str, ops: dict[str, dict[str, float]], top: int = 12) -> None:
    kiln, peer = ops["kiln"], ops["onnxruntime-genai"]
    per = "prefill of one generate" if key.endswith("prefill") else "one decode call"
    table = Table(title=f"where the engine time goes: {key} (median ms for {per}, by op type)")
    for col in ("op type", "kiln", "onnxruntime-genai"):
        table.add_column(col, justify="left" if col == "op type" else "right")
    counts = (CALLS, NODES)
    names = sorted((set(kiln) | set(peer)) - set(counts), key=lambda k: -max(kiln.get(k, 0), peer.get(k, 0)))
    for name in names[:top + 1]:
        table.add_row(name, f"{kiln.get(name, 0):.2f}", f"{peer.get(name, 0):.2f}")
    gaps = [_between_kernels(o) for o in (kiln, peer)]
    table.add_row("(whole run − kernels: dispatch between nodes)", *(f"{g:.2f}" for g in gaps))
    for name in counts:
        table.add_row(name, f"{kiln.get(name, 0):g}", f"{peer.get(name, 0):g}")
    console.print(table)


def profile_python(runner: KilnRunner, prompts: list[list[int]], n: int = 16, top: int = 12) -> list[dict]:
    """cProfile of a 32-stream generate: the Python functions that cost the most, engine excluded."""
    import cProfile
    import pstats

    runner.generate(prompts, n)
    prof = cProfile.Profile()
    prof.enable()
    runner.generate(prompts, n)
    prof.disable()
    stats = pstats.Stats(prof).stats
    rows = sorted(((f"{Path(f).name}:{line} {name}", calls, tt, ct) for (f, line, name), (_, calls, tt, ct, _) in
                   stats.items()), key=lambda r: -r[2])[:top]
    table = Table(title=f"kiln Python, B={len(prompts)}, {n} tokens (cProfile; the engine is the 'run' row)")
    for col in ("function", "calls", "self s", "cumulative s"):
        table.add_column(col, justify="left" if col == "function" else "right")
    for name, calls, tt, ct in rows:
        table.add_row(name, str(calls), f"{tt:.3f}", f"{ct:.3f}")
    console.print(table)
    return [dict(zip(("function", "calls", "self_s", "cumulative_s"), r)) for r in rows]
