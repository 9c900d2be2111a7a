"""bench_runtime.py's results: one line of medians per system, the issue's ratios against their
targets, the greedy agreement line, and the JSON."""

from __future__ import annotations

import os
import shlex
from dataclasses import asdict, dataclass, field

from bench.peers import Run
from rich.table import Table
from bench.runtime_console import console
from bench.runtime_workloads import ANSWER, QUESTION, Sizes, median

METRICS = {"ttft_ms": ("TTFT 512", "ms"), "1-stream": ("1 stream", "tok/s"),
           "8-way": ("8-way", "tok/s"), "32-way": ("32-way", "tok/s")}


@dataclass
class Summary:
    """One system's medians over its repetitions."""
    system: str                   # the spec: kiln:ort:int8, genai:int4, openvino:int8, hf:fp32
    name: str
    metrics: dict[str, float] = field(default_factory=dict)
    chat: str = ""
    single_ids: list[int] = field(default_factory=list)
    overhead_pct: float | None = None  # kiln: 1 - engine time / step time over 32-way decode-only steps
    setup_s: float = 0.0
    error: str | None = None

    @property
    def is_kiln(self) -> bool:
        return self.system.startswith("kiln:")

    @property
    def quant(self) -> str:
        """The weights the targets compare: a default build's come from its label (what it chose)."""
        if self.name.startswith("kiln defaults"):
            return self.name.rsplit(" ", 1)[-1]
        return self.system.rsplit(":", 1)[-1]


def summarize(result: dict, tokenizer) -> Summary:
    if "error" in result:
        return Summary(result["system"], result.get("name", result["system"]), error=result["error"])
    runs = {w: [Run(r["first_token_s"], r["total_s"], r["token_ids"]) for r in rs] for w, rs in result["runs"].items()}
    metrics = {"ttft_ms": 1e3 * median(r.first_token_s for r in runs["ttft"]),
               "1-stream": median(r.decode_tokens_per_s() for r in runs["single"])}
    metrics |= {w: median(r.aggregate_tokens_per_s() for r in rs) for w, rs in runs.items() if w.endswith("-way")}
    answer = runs["chat"][0].token_ids[0]
    if tokenizer.eos_token_id in answer:
        answer = answer[:answer.index(tokenizer.eos_token_id)]
    decode = [r["decode"] for r in result["runs"].get("32-way", []) if "decode" in r]
    overhead = median(100 * (1 - d["engine_s"] / d["wall_s"]) for d in decode if d["wall_s"]) if decode else None
    return Summary(result["system"], result["name"], metrics, tokenizer.decode(answer).strip(),
                   runs["single"][-1].token_ids[0], overhead, result.get("setup_s", 0.0))


# -- the targets --------------------------------------------------------------------------

@dataclass(frozen=True)
class Target:
    metric: str                   # a METRICS key
    kiln_quant: str               # every kiln system of this quant mode is held to it
    peer: str                     # the peer's system spec
    bound: float                  # on kiln / peer
    higher_is_better: bool
    profile: tuple = ()           # (batch, phase) to profile where it misses


TARGETS = [Target("ttft_ms", "int8", "openvino:int8", 1.0, False, ((1, "prefill"),)),
           Target("1-stream", "int4", "genai:int4", 1.2, True, ((1, "decode"),)),
           Target("1-stream", "int8", "openvino:int8", 1.0, True, ((1, "decode"),)),
           Target("32-way", "int8", "openvino:int8", 1.5, True, ((32, "prefill"), (32, "decode")))]
# w8a8 stores int8 weights like int8 (its activations are int8 too): held to the int8 targets.
TARGET_QUANT = {"w8a8": "int8"}
OVERHEAD_PCT = 15.0               # kiln's Python share of a decode-only step at batch 32


@dataclass
class Row:
    metric: str
    kiln_name: str
    kiln: float | None
    peer_name: str
    peer: float | None
    unit: str
    target: float
    higher_is_better: bool
    met: bool | None              # None: a side is missing
    cases: tuple = ()             # ((kiln spec, peer spec or None, batch, phase), ...) to profile

    @property
    def ratio(self) -> float | None:
        return self.kiln / self.peer if self.kiln is not None and self.peer else None


def target_rows(summaries: list[Summary]) -> list[Row]:
    by_spec = {s.system: s for s in summaries if s.error is None}
    rows = []
    for k in (s for s in summaries if s.is_kiln and s.error is None):
        weights = k.quant.split("@")[0].split("+")[0]     # int8+w8a8@gqa: int8, a w8a8 prefill engine, GQA decode
        for t in (t for t in TARGETS if t.kiln_quant == TARGET_QUANT.get(weights, weights)):
            rows.append(_ratio_row(t, k, by_spec.get(t.peer)))
        rows.append(Row(f"chat answer names {ANSWER}", k.name, None, "", None, "", 1, True, ANSWER in k.chat))
        if k.overhead_pct is not None:
            rows.append(Row("Python overhead / decode step, B=32", k.name, k.overhead_pct, "", None, "%",
                            OVERHEAD_PCT, False, k.overhead_pct <= OVERHEAD_PCT, ((k.system, None, 32, "python"),)))
    return rows


def _ratio_row(t: Target, k: Summary, peer: Summary | None) -> Row:
    label, unit = METRICS[t.metric]
    mine, theirs = k.metrics.get(t.metric), peer.metrics.get(t.metric) if peer else None
    met = None
    if mine is not None and theirs:
        met = mine / theirs >= t.bound if t.higher_is_better else mine / theirs <= t.bound
    # Profiling compares against onnxruntime-genai only (same runtime, per-op profiles match).
    genai = t.peer if t.peer.startswith("genai:") else None
    return Row(label, k.name, mine, peer.name if peer else t.peer, theirs, unit, t.bound, t.higher_is_better, met,
               tuple((k.system, genai, b, phase) for b, phase in t.profile))


# -- printing -------------------------------------------------------------------------------------

def print_systems(summaries: list[Summary]) -> None:
    table = Table(title="every system, median of repetitions (same weights, greedy, same threads)")
    for col in ("system", *(label for label, _ in METRICS.values()), "chat answer"):
        table.add_column(col, justify="left" if col in ("system", "chat answer") else "right")
    for s in summaries:
        if s.error:
            table.add_row(s.name, *["—"] * len(METRICS), f"[red]failed: {s.error}[/]")
            continue
        cells = [_fmt(s.metrics.get(m), unit) for m, (_, unit) in METRICS.items()]
        table.add_row(s.name, *cells, _short(s.chat))
    console.print(table)


def print_targets(rows: list[Row]) -> None:
    table = Table(title="the issue's targets (ratio = kiln / peer)")
    for col in ("metric", "kiln", "value", "peer", "peer value", "ratio", "target", "met?"):
        table.add_column(col, justify="left" if col in ("metric", "kiln", "peer") else "right")
    for r in rows:
        sign = "≥" if r.higher_is_better else "≤"
        target = "" if not r.unit else f"{sign} {r.target:g}{'%' if r.unit == '%' else '×'}"
        ratio = f"{r.ratio:.2f}×" if r.ratio is not None else "—"
        met = {True: "[green]met[/]", False: "[red]missed[/]", None: "[yellow]not measured[/]"}[r.met]
        table.add_row(r.metric, r.kiln_name, _fmt(r.kiln, r.unit), r.peer_name or "—", _fmt(r.peer, r.unit),
                      ratio, target, met)
    console.print(table)


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "—"
    return f"{value:.1f} %" if unit == "%" else f"{value:,.1f} {unit}"


def _short(text: str, width: int = 48) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 1] + "…"


def agreement(summaries: list[Summary]) -> dict[str, int]:
    """Single stream: greedy tokens each system shares with the reference (kiln fp32, else the
    first kiln system) before they differ. fp32 peers should match; quantized ones part at near-ties."""
    ok = [s for s in summaries if s.error is None]
    kiln = [s for s in ok if s.is_kiln]
    if not kiln:
        return {}
    ref = next((s for s in kiln if s.quant == "fp32"), kiln[0])
    ok = [ref] + [s for s in ok if s is not ref]        # NOTE: the reference comes first
    return {s.name: next((i for i, (a, b) in enumerate(zip(ref.single_ids, s.single_ids)) if a != b),
                         min(len(ref.single_ids), len(s.single_ids))) for s in ok}


def print_agreement(same: dict[str, int], n: int) -> None:
    ref = next(iter(same))
    parts = ", ".join(f"{name} {k}" for name, k in same.items() if name != ref)
    console.print(f"greedy tokens (of {n}) matching {ref} before the first difference: {parts}")


def run_record(args) -> dict:
    """What bench/render_results.py needs of every results file: when, on what CPU, by which command."""
    import sys
    from datetime import datetime, timezone

    from kiln.contract.cpu import host

    now = datetime.now(timezone.utc)
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 "unknown")
    return {"date": now.strftime("%Y-%m-%d"), "time_utc": now.strftime("%H:%M"), "cpu": model,
            "cpu_class": host().cpu_class, "command": shlex.join(["python", "-m", "bench.bench_runtime", *sys.argv[1:]]),
            "journal": args.journal}


def to_json(args, sizes: Sizes, summaries: list[Summary], rows: list[Row], results: dict, load: tuple,
            profiles: dict) -> dict:
    def runs(result: dict) -> dict:
        return {w: [{"first_token_s": r["first_token_s"], "total_s": r["total_s"],
                     "new_tokens": sum(map(len, r["token_ids"])), **({"decode": r["decode"]} if "decode" in r else {})}
                    for r in rs] for w, rs in result.get("runs", {}).items()}

    return {**run_record(args), "mode": "quick" if args.quick else "full", "sizes": asdict(sizes), "threads": args.threads,
            "chat_question": QUESTION, "chat_expects": ANSWER,
            "machine": {"cpus": os.cpu_count(), "load_avg_start": load[0], "load_avg_end": load[1]},
            "systems": {s.system: {"name": s.name, "metrics": s.metrics, "chat_answer": s.chat,
                                   "python_overhead_pct": s.overhead_pct, "setup_s": s.setup_s, "error": s.error,
                                   "runs": runs(results[s.system])} for s in summaries},
            "targets": [{**asdict(r), "ratio": r.ratio} for r in rows],
            "greedy_agreement_tokens": agreement(summaries),
            "unverified_kiln_builds": {p.name: p.read_text() for p in sorted(args.cache.glob("kiln-*.UNVERIFIED"))},
            "profiles": profiles}
