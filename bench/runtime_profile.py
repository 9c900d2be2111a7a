"""Where kiln's time goes, for the targets it misses: ONNX Runtime's per-op-type profile of kiln's
engine next to onnxruntime-genai's for the same step (kiln's alone where the peer is not genai), and
cProfile of kiln's Python step. bench_runtime.py runs it as a process of its own, after the systems:

    python -m bench.runtime_profile --plan PLAN.json --cases '[["kiln:ort:int4", "genai:int4", 1, "decode"]]' --out OUT
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from bench.peers import GenAIRunner
from rich.table import Table
from bench.runtime_console import console
from bench.runtime_kiln import KilnRunner, ensure_kiln

HERE = Path(__file__).parent
GENAI = "onnxruntime-genai"


def profile_misses(cases: list[tuple], plan: dict) -> dict:
    """cases: (kiln spec, genai spec or None, batch, phase); phase is prefill, decode or python."""
    out, runners = {}, {}
    prompts = plan["prompts"]
    for kiln_spec, genai_spec, batch, phase in cases:
        key = f"{kiln_spec} vs {genai_spec or '-'}, B={batch}, {phase}"
        kiln = runners.get(kiln_spec) or runners.setdefault(kiln_spec, _kiln_runner(kiln_spec, plan))
        if phase == "python":
            out[key] = profile_python(kiln, prompts[f"{batch}-way"])
            continue
        workload = prompts[f"{batch}-way"] if batch > 1 else prompts["ttft" if phase == "prefill" else "single"]
        genai = _genai_dir(genai_spec, plan)
        with console.status(f"profiling {key}"):
            out[key] = profile_engines(kiln, genai, plan["threads"], workload, phase)
        print_ops(key, out[key])
    return out


def _kiln_runner(spec: str, plan: dict) -> KilnRunner:
    _, backend, quant = spec.split(":")
    artifact = ensure_kiln(Path(plan["cache"]), backend, quant, reuse=plan.get("reuse_kiln", False))
    return KilnRunner(artifact, plan["threads"], f"{backend} {quant}")


def _genai_dir(spec: str | None, plan: dict) -> Path | None:
    return Path(plan["cache"]) / f"genai-{spec.split(':')[1]}" if spec else None


def profile_engines(kiln: KilnRunner, genai_dir: Path | None, threads: int, prompts: list[list[int]], phase: str,
                    rounds: int = 3) -> dict[str, dict[str, float]]:
    """ORT's per-op profile of kiln's engine and genai's for the same generate, round-robin.

    Both run profiling sessions side by side, alternating, the first round dropped (warm-up), so
    drifting load hits both alike; each op's figure is its median over engine calls (decode) or
    over generates (prefill: kiln splits a 32-prompt prefill into chunks by its token budget).
    """
    import gc

    n = 1 if phase == "prefill" else 8
    prefix = HERE / ".cache" / f"profile-genai-{time.time_ns()}"
    peer = GenAIRunner(genai_dir, threads, "profiled", {"enable_profiling": str(prefix)}) if genai_dir else None
    engine, index, recorder = _swap_in_profiling(kiln, len(prompts), phase)
    starts = []
    try:
        for _ in range(rounds):
            starts.append(len(recorder.shapes))
            kiln.generate(prompts, n)
            if peer:
                peer.generate(prompts, n)
    finally:
        engine.sessions[index] = (engine.sessions[index][0], recorder.original)
        engine._bindings[index] = recorder.original_binding
    shapes = recorder.shapes
    kiln_units = _kiln_units(_model_runs(recorder.session.end_profiling()), shapes, starts[1:] + [len(shapes)], phase)
    if peer is None:
        return {"kiln": _median(kiln_units)}
    del peer
    gc.collect()                                       # genai writes its profile when the session goes
    genai_runs = _model_runs(str(max(prefix.parent.glob(prefix.name + "*.json"), key=os.path.getmtime)))
    per_generate = [genai_runs[i:i + n] for i in range(n, len(genai_runs), n)]
    genai_units = [g[0] for g in per_generate] if phase == "prefill" else [r for g in per_generate for r in g[1:]]
    return {"kiln": _median(kiln_units), GENAI: _median(genai_units)}


class _RecordingSession:
    """A profiling session in the engine's place; remembers each call's [batch, seq] shape. NOTE:
    the engine runs its calls through an IOBinding made on its own session (the KV pool bound
    once), so the profiling session gets one of its own (_RecordingBinding), swapped in beside it."""

    def __init__(self, session, original, original_binding):
        self.session, self.original, self.original_binding, self.shapes = session, original, original_binding, []

    def run_with_iobinding(self, binding: _RecordingBinding):
        self.session.run_with_iobinding(binding.binding)


class _RecordingBinding:
    """The profiling session's IOBinding as the engine's: each call's input_ids shape recorded."""

    def __init__(self, binding, shapes: list):
        self.binding, self.shapes = binding, shapes

    def bind_cpu_input(self, name, value):
        if name == "input_ids":
            self.shapes.append(value.shape)
        self.binding.bind_cpu_input(name, value)

    def __getattr__(self, name):
        return getattr(self.binding, name)


def _swap_in_profiling(runner: KilnRunner, batch: int, phase: str):
    """kiln's ORT engine (Engine.execute -> run_with_iobinding per bucket call) on a profiling session:
    the one of its engines that serves this phase (an artifact with a prefill engine has two)."""
    from kiln.engines.ort.engine import bind_pool

    engine = runner.llm.core.engine
    if not hasattr(engine, "sessions"):
        raise SystemExit(f"{runner.name}: per-op profiles need the ONNX Runtime backend")
    last = len(engine.sessions) - 1
    index = last if phase == "prefill" or batch >= engine.sessions[last][0] else 0
    artifact = runner.llm.artifact
    model_path = artifact.path / [e["file"] for e in artifact.manifest.engines if e["backend"] == "ort"][index]
    min_tokens, original = engine.sessions[index]
    recorder = _RecordingSession(_profiling_session(model_path, engine.threads), original, engine._bindings[index])
    engine.sessions[index] = (min_tokens, recorder)
    engine._bindings[index] = _RecordingBinding(bind_pool(recorder.session, engine.pool), recorder.shapes)
    return engine, index, recorder


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

    from kiln.engines.ort.session import cpu_session, session_options

    # The options kiln's OrtEngine uses (the artifact is optimized offline), plus profiling.
    opts = session_options(threads, ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    opts.enable_profiling = True
    opts.profile_file_prefix = str(HERE / ".cache" / "profile-kiln")
    return cpu_session(str(model_path), opts)


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
    sides = ops                      # kiln, and onnxruntime-genai where it is the peer
    per = "prefill of one generate" if key.endswith("prefill") else "one decode call"
    table = Table(title=f"where the engine time goes: {key} (median ms for {per}, by op type)")
    for col in ("op type", *sides):
        table.add_column(col, justify="left" if col == "op type" else "right")
    counts = (CALLS, NODES)
    names = sorted(set().union(*sides.values()) - set(counts), key=lambda k: -max(o.get(k, 0) for o in sides.values()))
    for name in names[:top + 1]:
        table.add_row(name, *(f"{o.get(name, 0):.2f}" for o in sides.values()))
    table.add_row("(whole run − kernels: dispatch between nodes)", *(f"{_between_kernels(o):.2f}" for o in sides.values()))
    for name in counts:
        table.add_row(name, *(f"{o.get(name, 0):g}" for o in sides.values()))
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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--plan", type=Path, required=True)
    ap.add_argument("--cases", required=True, help="JSON list of [kiln spec, genai spec or null, batch, phase]")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    import logging

    logging.getLogger("kiln").setLevel(logging.WARNING)
    out = profile_misses([tuple(c) for c in json.loads(args.cases)], json.loads(args.plan.read_text()))
    args.out.write_text(json.dumps(out))


if __name__ == "__main__":
    main()
