"""kiln's runtime side by side with its peers on the same SmolLM2 weights, in one process and one run.

    .venv/bin/python bench/bench_runtime.py            # full run (~10 min on 2 cores)
    .venv/bin/python bench/bench_runtime.py --quick    # smoke run: few tokens, one repetition

Measures, greedy and with exactly N new tokens everywhere, every engine on the same threads:
- single-stream decode tokens/s: kiln vs HF transformers `generate` (fp32) and vs
  onnxruntime-genai at the same precision (fp32, int4);
- 32 concurrent requests, aggregate tokens/s: kiln's in-flight batch vs onnxruntime-genai's
  static batch of 32 (it has no continuous batching on CPU);
- TTFT of a 512-token prompt: kiln vs onnxruntime-genai;
- kiln's Python overhead per decode-only step at batch 32: 1 - time in engine.run / step time.
Prints a table of ratios against the runtime issue's targets and writes bench/results/runtime.json;
where kiln misses a target it profiles where the time goes: ONNX Runtime's per-op-type profile of
kiln's engine next to onnxruntime-genai's for the same step, or cProfile of kiln's Python step.
These are benchmarks, not tests: nothing here asserts on a time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

# NOTE: transformers' GGUF loader draws tqdm bars of its own; tqdm reads this when it is imported.
os.environ.setdefault("TQDM_DISABLE", "1")
sys.path.insert(0, str(Path(__file__).parent))
from peers import GenAIRunner, HFRunner, Run, build_genai, load_hf_gguf, write_hf_folder  # noqa: E402

from kiln import LLM, RuntimeConfig, SamplingParams, SchedulerConfig  # noqa: E402
from kiln.tokenizer import Tokenizer  # noqa: E402

HERE = Path(__file__).parent
TEXT = HERE.parent / "tests" / "data" / "perplexity.txt"
# NOTE: rich falls back to 80 columns when stdout is a file or pipe; the tables need more.
console = Console(width=None if sys.stdout.isatty() else 132)


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


# -- kiln -----------------------------------------------------------------------------------------

@dataclass
class DecodeSteps:
    """Sums over the steps kiln's engine core counted as decode-only (no prefill chunk in them)."""
    steps: int = 0
    wall_s: float = 0.0           # the whole step as the caller sees it, detokenization included
    core_s: float = 0.0           # EngineCore.step alone (schedule, runner, update)
    engine_s: float = 0.0         # inside engine.run

    @property
    def overhead(self) -> float:
        return 1 - self.engine_s / self.wall_s if self.wall_s else float("nan")

    @property
    def core_overhead(self) -> float:
        return 1 - self.engine_s / self.core_s if self.core_s else float("nan")


@dataclass
class KilnRun(Run):
    decode: DecodeSteps = field(default_factory=DecodeSteps)


class KilnRunner:
    """LLM.generate's loop, step by step, so decode-only steps can be timed apart from prefill."""

    def __init__(self, artifact: Path, threads: int, label: str):
        self.name = f"kiln {label}"
        # NOTE: no prefix caching: every repetition sends the same prompts, and a cache hit would
        # skip the prefill the peers pay for.
        scheduler = SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=1024, enable_prefix_caching=False)
        self.llm = LLM(artifact, RuntimeConfig(kv_cache_memory=2 << 30, threads=threads, scheduler=scheduler))

    def generate(self, prompts: list[list[int]], n: int) -> KilnRun:
        llm, core = self.llm, self.llm.core
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        requests = [llm.make_request(p, params) for p in prompts]
        decode, first = DecodeSteps(), None
        t0 = time.perf_counter()
        for r in requests:
            core.add_request(r)
            llm.outputs.add(r)
        while core.has_unfinished():
            if self._step(decode) and first is None:
                first = time.perf_counter() - t0
        total = time.perf_counter() - t0
        return KilnRun(first, total, [llm.outputs.result(r).token_ids for r in requests], decode)

    def _step(self, decode: DecodeSteps) -> bool:
        core = self.llm.core
        engine0, core0, decode0 = core.runner.stats.engine_seconds, core.stats.step_seconds, core.stats.decode_seconds
        t0 = time.perf_counter()
        deltas = core.step()
        for d in deltas:
            self.llm.outputs.process(d)
        wall = time.perf_counter() - t0
        if core.stats.decode_seconds > decode0:        # the core classified this step decode-only
            decode.steps += 1
            decode.wall_s += wall
            decode.core_s += core.stats.step_seconds - core0
            decode.engine_s += core.runner.stats.engine_seconds - engine0
        return bool(deltas)


def ensure_kiln(cache: Path, quant: str) -> Path:
    """The kiln artifact for one precision, built into the cache when kiln's build code changes."""
    name = f"kiln-{quant}-{_build_code_hash()}"
    out, marker = cache / name, cache / f"{name}.UNVERIFIED"
    if not (out / "manifest.json").is_file():
        for stale in cache.glob(f"kiln-{quant}*"):
            shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
        _build_kiln(out, quant, marker)
    if marker.is_file():
        console.print(f"[bold red]kiln {quant} was built without its numeric checks ({marker.read_text()}); "
                      f"delete {out}* to retry the checked build[/]")
    return out


def _build_code_hash() -> str:
    """A hash of the code that shapes an artifact: others change passes while a cache lives on."""
    import hashlib

    import kiln

    root = Path(kiln.__file__).parent
    files = [root / "build.py", *sorted(f for d in ("export", "passes", "engines") for f in (root / d).rglob("*.py"))]
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.read_bytes())
    return digest.hexdigest()[:10]


def _build_kiln(out: Path, quant: str, marker: Path) -> None:
    from kiln.build import BuildConfig, build
    from kiln.passes.base import PassCheckError
    from kiln.passes.quantize import QuantMode

    mode = QuantMode.NONE if quant == "fp32" else QuantMode(quant)
    with console.status(f"building kiln {quant}") as status:
        try:
            build(BuildConfig("smollm2-135m", out, quant=mode), stage=lambda name: _stage(status, name))
        except PassCheckError as e:
            # NOTE: speed does not depend on the check; the agreement line shows what quality is left.
            marker.write_text(str(e))
            build(BuildConfig("smollm2-135m", out, quant=mode, verify=False), stage=lambda name: _stage(status, name))


def _stage(status, name: str):
    from contextlib import nullcontext

    status.update(f"building kiln: {name}")
    return nullcontext()


# -- workloads ------------------------------------------------------------------------------------

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


# -- results --------------------------------------------------------------------------------------

@dataclass
class Row:
    metric: str
    kiln: float
    peer_name: str
    peer: float | None
    unit: str                     # "tok/s", "ms" or "%"
    target: float                 # on the ratio kiln/peer, or on kiln's value where there is no peer
    higher_is_better: bool
    cases: tuple                  # ((precision, batch, phase), ...): what to profile if it misses

    @property
    def ratio(self) -> float | None:
        return self.kiln / self.peer if self.peer else None

    @property
    def met(self) -> bool:
        value = self.ratio if self.peer is not None else self.kiln
        return value >= self.target if self.higher_is_better else value <= self.target


def rows_for(precision: str, results: dict) -> list[Row]:
    k, g = f"kiln {precision}", f"onnxruntime-genai {precision}"
    single, batch, ttft = results["single"], results["batch"], results["ttft"]
    dec, agg = Run.decode_tokens_per_s, Run.aggregate_tokens_per_s
    rows = []
    if "HF transformers" in single:
        rows.append(Row(f"decode tok/s, 1 stream, {precision}", median(single[k], dec), "HF transformers",
                        median(single["HF transformers"], dec), "tok/s", 3.0, True, ((precision, 1, "decode"),)))
    rows += [
        Row(f"decode tok/s, 1 stream, {precision}", median(single[k], dec), g, median(single[g], dec),
            "tok/s", 1.0, True, ((precision, 1, "decode"),)),
        Row(f"aggregate tok/s, 32 streams, {precision}", median(batch[k], agg), g, median(batch[g], agg),
            "tok/s", 1.2, True, ((precision, 32, "prefill"), (precision, 32, "decode"))),
        Row(f"TTFT, 512-token prompt, {precision}", 1e3 * median(ttft[k], lambda r: r.first_token_s), g,
            1e3 * median(ttft[g], lambda r: r.first_token_s), "ms", 1.0, False, ((precision, 1, "prefill"),)),
        Row(f"Python overhead / decode step, B=32, {precision}", 100 * median(batch[k], lambda r: r.decode.overhead),
            "", None, "%", 15.0, False, ((precision, 32, "python"),)),
    ]
    return rows


def print_table(rows: list[Row]) -> None:
    table = Table(title="kiln vs peers (median of repetitions; same weights, greedy, same threads)")
    for col in ("metric", "kiln", "peer", "peer value", "ratio", "target", "met?"):
        table.add_column(col, justify="left" if col in ("metric", "peer") else "right")
    for r in rows:
        ratio = f"{r.ratio:.2f}×" if r.ratio is not None else "—"
        sign = "≥" if r.higher_is_better else "≤"
        target = f"{sign} {r.target:g}%" if r.peer is None else f"{sign} {r.target:g}×"
        met = "[green]yes[/]" if r.met else "[red]no[/]"
        peer_value = _fmt(r.peer, r.unit) if r.peer is not None else "—"
        table.add_row(r.metric, _fmt(r.kiln, r.unit), r.peer_name or "—", peer_value, ratio, target, met)
    console.print(table)


def phase_split(results: dict) -> list[dict]:
    """Where the 32-stream runs' time went: steps that prefill (kiln's also decode the requests
    already prefilled), then decoding alone, per step. Medians over the repetitions."""
    out = []
    for precision, res in results.items():
        for name, runs in res["batch"].items():
            out.append({"precision": precision, "system": name,
                        "prefill_phase_s": statistics.median(_prefill_phase(r) for r in runs),
                        "decode_ms_per_step": statistics.median(_decode_step_ms(r) for r in runs),
                        "total_s": statistics.median(r.total_s for r in runs)})
    return out


def _prefill_phase(r: Run) -> float:
    return r.total_s - r.decode.wall_s if isinstance(r, KilnRun) else r.first_token_s


def _decode_step_ms(r: Run) -> float:
    if isinstance(r, KilnRun):
        return 1e3 * r.decode.wall_s / max(r.decode.steps, 1)
    return 1e3 * (r.total_s - r.first_token_s) / max(len(r.token_ids[0]) - 1, 1)


def print_phases(phases: list[dict]) -> None:
    table = Table(title="32 streams: where each run's time goes (median)")
    for col in ("precision", "system", "prefill phase s", "decode ms/step (B=32)", "total s"):
        table.add_column(col, justify="left" if col in ("precision", "system") else "right")
    for p in phases:
        table.add_row(p["precision"], p["system"], f"{p['prefill_phase_s']:.2f}", f"{p['decode_ms_per_step']:.1f}",
                      f"{p['total_s']:.2f}")
    console.print(table)


def _fmt(value: float, unit: str) -> str:
    return f"{value:.1f} %" if unit == "%" else f"{value:,.1f} {unit}"


def agreement(results: dict) -> dict[str, int]:
    """Single stream: greedy tokens each system shares with the first kiln run before they differ.

    Checks that everyone did the same work; quantized engines may part early (near-ties)."""
    singles = {name: runs[-1].token_ids[0] for res in results.values() for name, runs in res["single"].items()}
    ref = singles[next(n for n in singles if n.startswith("kiln"))]
    return {name: next((i for i, (a, b) in enumerate(zip(ref, toks)) if a != b), min(len(ref), len(toks)))
            for name, toks in singles.items()}


def print_agreement(same: dict[str, int], n: int) -> None:
    ref = next(iter(same))
    parts = ", ".join(f"{name} {k}" for name, k in same.items() if name != ref)
    console.print(f"greedy tokens (of {n}) matching {ref} before the first difference: {parts}")


def to_json(args, sizes: Sizes, rows: list[Row], results: dict, load: tuple, profiles: dict) -> dict:
    def run_dict(r: Run) -> dict:
        d = {"first_token_s": r.first_token_s, "total_s": r.total_s, "new_tokens": sum(map(len, r.token_ids))}
        if isinstance(r, KilnRun):
            d["decode_steps"] = {**asdict(r.decode), "overhead": r.decode.overhead,
                                 "core_overhead": r.decode.core_overhead}
        return d

    return {"mode": "quick" if args.quick else "full", "sizes": asdict(sizes), "threads": args.threads,
            "machine": {"cpus": os.cpu_count(), "load_avg_start": load[0], "load_avg_end": load[1]},
            "rows": [{**asdict(r), "ratio": r.ratio, "met": r.met} for r in rows],
            "runs": {p: {w: {name: [run_dict(r) for r in runs] for name, runs in by.items()}
                         for w, by in res.items()} for p, res in results.items()},
            "greedy_agreement_tokens": agreement(results),
            "unverified_kiln_builds": {p.name: p.read_text() for p in sorted(args.cache.glob("kiln-*.UNVERIFIED"))},
            "batch_phases": phase_split(results),
            "profiles": profiles}


# -- where kiln's time goes (for missed targets) --------------------------------------------------

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


# -- main -----------------------------------------------------------------------------------------

def setup(args, precisions: list[str]) -> tuple[dict, dict, object]:
    """Build or load every model; returns kiln runners, genai runners and the HF model."""
    cache = args.cache
    with console.status("loading SmolLM2 into HF transformers (fp32, from the GGUF)"):
        hf_model, hf_tok = load_hf_gguf()
    hf_dir = write_hf_folder(hf_model, hf_tok, cache / "hf-smollm2")
    kiln, genai = {}, {}
    for p in precisions:
        artifact = ensure_kiln(cache, p)
        with console.status(f"building onnxruntime-genai {p} (its model builder, offline)"):
            genai_dir = build_genai(hf_dir, cache / f"genai-{p}", p, cache / "genai-cache")
        kiln[p] = KilnRunner(artifact, args.threads, p)
        genai[p] = GenAIRunner(genai_dir, args.threads, p)
    return kiln, genai, hf_model


def run_all(args, sizes: Sizes, kiln: dict, genai: dict, hf) -> dict:
    prompts = make_prompts(kiln[next(iter(kiln))].llm.tokenizer, sizes)
    results = {}
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    with Progress(*columns, console=console) as progress:
        for p in kiln:
            single = [kiln[p], genai[p]] + ([hf] if p == "fp32" else [])
            results[p] = {
                "single": measure(single, prompts["single"], sizes.decode_tokens, sizes.reps, progress,
                                  f"{p} single stream"),
                "batch": measure([kiln[p], genai[p]], prompts["batch"], sizes.batch_tokens, sizes.reps,
                                 progress, f"{p} 32 streams"),
                "ttft": measure([kiln[p], genai[p]], prompts["ttft"], 1, sizes.reps, progress, f"{p} TTFT 512"),
            }
    return results


def _quiet() -> None:
    """Keep the progress display readable: no per-tensor bars from transformers, no INFO logs."""
    import logging

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    logging.getLogger("kiln").setLevel(logging.WARNING)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: few tokens, one repetition")
    ap.add_argument("--precisions", default="fp32,int4", help="comma-separated: fp32, int4 (int8: untried)")
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads for every engine")
    ap.add_argument("--cache", type=Path, default=HERE / ".cache", help="built models (reused)")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "runtime.json")
    ap.add_argument("--profile", choices=("auto", "always", "never"), default="auto",
                    help="profile where kiln's time goes: only for missed targets by default")
    args = ap.parse_args(argv)
    sizes = SIZES["quick" if args.quick else "full"]
    precisions = args.precisions.split(",")
    load_start = os.getloadavg()
    _quiet()
    kiln, genai, hf_model = setup(args, precisions)
    results = run_all(args, sizes, kiln, genai, HFRunner(hf_model, args.threads))
    rows = [row for p in precisions for row in rows_for(p, results[p])]
    load_end = os.getloadavg()
    print_table(rows)
    phases = phase_split(results)
    print_phases(phases)
    print_agreement(agreement(results), sizes.decode_tokens)
    console.print(f"load average (1 min) at start {load_start[0]:.2f}, at end {load_end[0]:.2f} "
                  f"on {os.cpu_count()} CPUs: anything well above 0 means shared cores and noisy figures")
    profiles = {}
    if args.profile != "never":
        cases = {c for r in rows if args.profile == "always" or not r.met for c in r.cases}
        profiles = profile_misses(sorted(cases), kiln, genai, make_prompts(kiln[precisions[0]].llm.tokenizer, sizes))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(to_json(args, sizes, rows, results, (load_start, load_end), profiles), indent=1))
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
