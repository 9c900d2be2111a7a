"""Render the current figures from bench/results/*.json into docs/benchmarks.md and README.md.

Each JSON under bench/results/ is the latest stored run of one benchmark. Every record carries
where and when it ran (`date`, `time_utc`, `cpu`, `cpu_class`), the `command` that reproduces it and
the `journal` entry (docs/results/) that tells the story of that run; `title`, `note` and
`superseded` ({system name: why}) are optional. This script writes:

- docs/benchmarks.md, between `<!-- results:begin -->` and `<!-- results:end -->`: one table per
  JSON (the systems, then kiln / peer ratios), with its CPU, date, command and links;
- README.md, between the same markers: one line per kiln build and peer pair (ratios only, no dates),
  leaving out systems marked superseded.

    python -m bench.render_results           # rewrite both sections
    python -m bench.render_results --check   # exit 1 if either is not what the JSON gives

tests/docs/test_results_render.py runs the check, so a new or changed JSON fails the suite until it
is rendered. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
README = ROOT / "README.md"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
STAMP = "<!-- rendered by `python -m bench.render_results` from bench/results/*.json: edit the JSON, then rerun it -->"
REQUIRED = ("date", "time_utc", "cpu", "cpu_class", "command", "journal")
CPU_CLASSES = ("amx", "avx512-vnni", "avx512", "avx2", "other", None)
METRICS = (("ttft_ms", "TTFT 512"), ("1-stream", "1 stream"), ("8-way", "8-way"), ("32-way", "32-way"))


class ResultError(ValueError):
    """A result JSON this script cannot render: a field missing, or a shape it does not know."""


# -- reading -------------------------------------------------------------------------------------


def load(folder: Path = RESULTS) -> dict[str, object]:
    """{file name: parsed JSON} of every result, sorted by name."""
    return {p.name: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}


def meta(data: object) -> dict:
    """The run's record: the top-level fields (a list of records carries them on each)."""
    return data[0] if isinstance(data, list) and data else data if isinstance(data, dict) else {}


def problems(name: str, data: object) -> list[str]:
    """What a result lacks before it can be rendered ([] when nothing)."""
    records = data if isinstance(data, list) else [data]
    found = []
    for record in records:
        if not isinstance(record, dict):
            return [f"{name}: a record is not a JSON object"]
        missing = [k for k in REQUIRED if k not in record]
        if missing:
            found.append(f"{name}: add {missing} (null where the run did not record it)")
        elif record["cpu_class"] not in CPU_CLASSES:
            found.append(f"{name}: cpu_class {record['cpu_class']!r} is not one of {list(CPU_CLASSES)}")
        elif not re.fullmatch(r"\d{4}-\d{2}-\d{2}", str(record["date"])):
            found.append(f"{name}: date {record['date']!r} is not YYYY-MM-DD")
        elif not (ROOT / str(record["journal"]).partition("#")[0]).is_file():
            found.append(f"{name}: its journal entry {record['journal']} does not exist")
    if not found and kind(data) is None:
        found.append(f"{name}: no renderer knows this shape; add one to bench/render_results.py")
    return found[:1]


def kind(data: object) -> str | None:
    build_keys = {"mode", "bytes", "perplexity"}
    if isinstance(data, list) and data and all(isinstance(r, dict) and build_keys <= r.keys() for r in data):
        return "build"
    if not isinstance(data, dict):
        return None
    if {"systems", "targets"} <= data.keys():
        return "runtime"
    if "models" in data and all("systems" in m for m in data["models"].values()):
        return "gguf"
    if "cases" in data and all("ratio" in c for c in data["cases"]):
        return "speculative"
    if "runs" in data and all("levels" in r for r in data["runs"]):
        return "kiln-bench"
    if "results" in data and all({"system", "workload", "clients"} <= r.keys() for r in data["results"]):
        return "serving"
    if "rows" in data and all({"shape", "system", "decode_us", "prefill_us"} <= r.keys() for r in data["rows"]):
        return "attention"
    return None


ORDER = ("runtime", "gguf", "serving", "attention", "build", "speculative", "kiln-bench")


def ordered(results: dict[str, object]) -> list[tuple[str, object]]:
    """Peers first, newest run first within a kind; a result that cannot be rendered raises."""
    bad = [p for name, data in results.items() for p in problems(name, data)]
    if bad:
        raise ResultError("\n".join(bad))
    items = sorted(results.items(), key=lambda kv: kv[0])
    items.sort(key=lambda kv: meta(kv[1])["date"], reverse=True)
    return sorted(items, key=lambda kv: ORDER.index(kind(kv[1])))


# -- formatting ----------------------------------------------------------------------------------


def num(x: float, digits: int = 0) -> str:
    return f"{x:,.{digits}f}"


def ms(x: float) -> str:
    return f"{num(x)} ms" if x >= 100 else f"{num(x, 1)} ms"


def ratio(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}x"


# What a result file without chat_expects asked: the capital of France (bench/runtime_workloads.py says
# why the question changed).
EARLIER_EXPECTS = "Paris"


def expected_answer(data: dict) -> str:
    """The word a result file's chat answer should name."""
    return data.get("chat_expects", EARLIER_EXPECTS)


def answer(text: str | None, expects: str) -> str:
    if not text:
        return "—"
    if expects in text:
        return expects
    short = text if len(text) <= 32 else text[:32].rstrip() + "…"
    return "no (“" + short.replace("|", "/") + "”)"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(r) + " |" for r in rows)]


def when(m: dict) -> str:
    return m["date"] + (f" {m['time_utc']} UTC" if m.get("time_utc") else "")


def cpu(m: dict) -> str:
    if not m.get("cpu"):
        return "a 2-core machine whose CPU the run did not record"
    return m["cpu"] + (f" (class `{m['cpu_class']}`)" if m.get("cpu_class") else "")


def header(name: str, m: dict) -> list[str]:
    journal = m["journal"].removeprefix("docs/")
    lines = [f"{when(m)}, {cpu(m)}. Data: [{name}](../bench/results/{name}); the run's story: "
             f"[journal]({journal}).", "", "```bash"]
    if m.get("server"):
        lines.append(m["server"] + " &")
    return lines + [m["command"], "```", ""]


def footer(name: str, m: dict, plots: list[str]) -> list[str]:
    out = []
    for system, why in (m.get("superseded") or {}).items():
        out.append(f"- *{system}* is superseded: {why}.")
    if m.get("note"):
        out.append(f"- {m['note']}")
    out = out + [""] if out else []
    for plot in plots:
        if (RESULTS / plot).is_file():
            out += [f"![{plot}](../bench/results/{plot})", ""]
    return out


def mark(system: str, m: dict) -> str:
    return f"{system} (superseded)" if system in (m.get("superseded") or {}) else system


# -- one renderer per kind -----------------------------------------------------------------------


def _named(data: dict) -> dict[str, dict]:
    return {s["name"]: s for s in data["systems"].values()}


def _pairs(data: dict) -> list[tuple[str, str]]:
    pairs = []
    for t in data["targets"]:
        pair = (t["kiln_name"], t["peer_name"])
        if t["peer_name"] and pair not in pairs:
            pairs.append(pair)
    return pairs


def _ratios(kiln: dict, peer: dict) -> list[float | None]:
    out = []
    for key, _ in METRICS:
        k, p = kiln["metrics"].get(key), peer["metrics"].get(key)
        out.append(k / p if k and p else None)
    return out


def _metric_cells(metrics: dict) -> list[str]:
    return [ms(metrics["ttft_ms"]), f"{num(metrics['1-stream'], 1)} tok/s", num(metrics["8-way"]), num(metrics["32-way"])]


def render_runtime(name: str, data: dict) -> list[str]:
    m, systems = meta(data), _named(data)
    out = [f"### {m.get('title') or 'kiln and its peers on ' + (m['cpu'] or 'an unrecorded CPU')}", ""] + header(name, m)
    out += table(["system", "TTFT 512", "1 stream", "8-way tok/s", "32-way tok/s", "chat answer"],
                 [[mark(n, m), *_metric_cells(s["metrics"]), answer(s.get("chat_answer"), expected_answer(data))]
                  for n, s in systems.items() if not s.get("error")])
    out += ["", "kiln / peer, from the same run (TTFT: below 1 is faster):", ""]
    out += table(["kiln build", "peer", "TTFT 512", "1 stream", "8-way", "32-way"],
                 [[mark(k, m), p, *map(ratio, _ratios(systems[k], systems[p]))] for k, p in _pairs(data)])
    rows = []
    for t in data["targets"]:
        if t["ratio"] is None and t["kiln"] is None:
            continue
        what = f"{t['metric']}, {t['kiln_name']}" + (f" / {t['peer_name']}" if t["peer_name"] else "")
        op = "≥" if t["higher_is_better"] else "≤"
        if t["ratio"] is not None:
            wanted, got = f"{op} {t['target']:.1f}x", ratio(t["ratio"])
        else:
            wanted, got = f"{op} {t['target']:g} {t['unit']}".rstrip(), f"{t['kiln']:.1f} {t['unit']}".rstrip()
        rows.append([what, wanted, got, "met" if t["met"] else "missed"])
    out += ["", "The benchmark's targets:", ""] + table(["target", "wanted", "measured", ""], rows) + [""]
    return out + footer(name, m, [name.removesuffix(".json") + ".png"])


def render_gguf(name: str, data: dict) -> list[str]:
    m = meta(data)
    out = [f"### {m.get('title') or 'kiln and llama.cpp on the same GGUF files'}", ""] + header(name, m)
    rows, ratio_rows = [], []
    for model in data["models"].values():
        for system, s in model["systems"].items():
            rows.append([model["gguf"], mark(system, m), *_metric_cells(s["metrics"]), answer(s.get("chat_answer"), expected_answer(data))])
        for system, r in model["ratios_kiln_over_llamacpp"].items():
            ratio_rows.append([model["gguf"], mark(system, m), *(ratio(r.get(k)) for k, _ in METRICS)])
    out += table(["file", "system", "TTFT 512", "1 stream", "8-way tok/s", "32-way tok/s", "chat answer"], rows)
    out += ["", "kiln / llama.cpp, from the same run (TTFT: below 1 is faster):", ""]
    out += table(["file", "kiln build", "TTFT 512", "1 stream", "8-way", "32-way"], ratio_rows) + [""]
    stem = name.removesuffix(".json")
    return out + footer(name, m, [f"{stem}-{model}.png" for model in data["models"]])


def render_build(name: str, data: list) -> list[str]:
    m = meta(data)
    fp32 = next((r for r in data if r["mode"] in ("none", "fp32")), data[0])
    out = [f"### {m.get('title') or 'Build time, size and perplexity'}", ""] + header(name, m)
    rows = [[r["mode"], f"{num(r['build_seconds'])} s", f"{num(r['bytes'] / 1e6)} MB", f"{r['bytes'] / fp32['bytes']:.3f}",
             f"{r['perplexity']:.3f}", "—" if r is fp32 else f"{100 * (r['perplexity'] / fp32['perplexity'] - 1):+.2f} %"]
            for r in data]
    out += table(["quant", "build", "artifact", "/ fp32", "perplexity", "over fp32"], rows) + [""]
    return out + footer(name, m, [])


def render_attention(name: str, data: dict) -> list[str]:
    m = meta(data)
    out = [f"### {m.get('title') or 'Paged attention alone: OpenVINO and kiln, one layer'}", ""] + header(name, m)
    rows = [[r["shape"], r["system"], f"{num(r['decode_us'])} us", ratio(r["decode_vs_openvino_u8"]),
             f"{num(r['prefill_us'] / 1e3, 1)} ms", ratio(r["prefill_vs_openvino_u8"])] for r in data["rows"]]
    out += table(["sequences x cached tokens", "system", "decode step", "/ openvino-u8", "prefill", "/ openvino-u8"],
                 rows) + [""]
    return out + footer(name, m, [])


def render_speculative(name: str, data: dict) -> list[str]:
    m = meta(data)
    out = [f"### {m.get('title') or 'Speculative decoding (`--speculative ngram`)'}", ""] + header(name, m)
    rows = []
    for c in data["cases"]:
        plain, ngram = (c["tokens"][k] / c["seconds"][k] for k in ("off", "ngram"))
        accepted = (f"{num(c['accepted'])} / {num(c['proposed'])} ({100 * c['accepted'] / c['proposed']:.0f} %)"
                    if c["proposed"] else "— (off)")
        rows.append([c["artifact"], c["workload"], str(c["streams"]), num(plain, 1), num(ngram, 1), ratio(c["ratio"]),
                     accepted, f"{c['identical']} / {c['outputs']}"])
    out += table(["artifact", "workload", "streams", "tok/s plain", "tok/s ngram", "ratio", "accepted / proposed",
                  "identical greedy outputs"], rows) + [""]
    return out + footer(name, m, [name.removesuffix(".json") + ".png"])


def render_kiln_bench(name: str, data: dict) -> list[str]:
    m = meta(data)
    targets = " and ".join(r["target"] for r in data["runs"])
    workload = data["runs"][0]["config"]["workload"]
    out = [f"### {m.get('title') or f'kiln bench, `{workload}` workload: {targets}'}", ""] + header(name, m)
    rows = []
    for run in data["runs"]:
        for level in run["levels"]:
            s = level["stats"]
            rows.append([run["target"], level["label"], num(s["output_tokens_per_s"], 1),
                         f"{num(1000 * s['ttft']['p50'])} / {num(1000 * s['ttft']['p99'])}",
                         f"{num(1000 * s['itl']['p50'])} / {num(1000 * s['itl']['p99'])}",
                         f"{100 * s['slo_attainment']:.0f} %" if s.get("slo_attainment") is not None else "—"])
    out += table(["target", "level", "out tok/s", "TTFT p50 / p99 ms", "ITL p50 / p99 ms", "met the objectives"], rows)
    if data.get("ratios"):
        out += ["", "kiln / peer, from the same run (every ratio above 1 favours kiln):", ""]
        keys = [k for k in data["ratios"][0] if k not in ("level", "peer")]
        out += table(["level", "peer", *keys],
                     [[r["level"], r["peer"], *(ratio(r[k]) for k in keys)] for r in data["ratios"]])
    return out + [""] + footer(name, m, [])


def render_serving(name: str, data: dict) -> list[str]:
    """bench/bench_serving.py: kiln serve against another server, the same client, per workload and clients."""
    m = meta(data)
    out = [f"### {m.get('title') or 'Serving: ' + ' vs '.join(data['systems'])}", ""] + header(name, m)
    rows = [[r["system"], r["workload"], str(r["clients"]), num(r["output_tokens_per_s"], 1),
             f"{num(1000 * (r['ttft_p50'] or 0))} / {num(1000 * (r['ttft_p99'] or 0))}",
             f"{num(1000 * (r['itl_p50'] or 0))} / {num(1000 * (r['itl_p99'] or 0))}",
             f"{r['served']} / {r['refused_429']}", _cpu_split(r)] for r in data["results"]]
    out += table(["server", "workload", "clients", "out tok/s", "TTFT p50 / p99 ms", "ITL p50 / p99 ms",
                  "served / 429", "CPU s: API / engine process"], rows)
    ratios = _serving_ratios(data)
    if ratios:
        out += ["", f"{data['systems'][0]} / {data['systems'][1]}, from the same run (tokens/s above 1 and TTFT "
                "p99 below 1 favour the first):", ""]
        out += table(["workload", "clients", "out tok/s", "TTFT p99"], ratios)
    return out + [""] + footer(name, m, [Path(name).with_suffix(".png").name])


def _cpu_split(r: dict) -> str:
    """The level's CPU seconds in the server's API process and in its engine process(es)."""
    cpu = r.get("cpu_seconds")
    if not cpu:
        return "—"
    return f"{num(cpu.get('api', 0), 1)} / {num(cpu['engine'], 1) if 'engine' in cpu else 'same process'}"


def _serving_ratios(data: dict) -> list[list[str]]:
    if len(data["systems"]) != 2:
        return []
    first, second = data["systems"]
    by_key = {(r["system"], r["workload"], r["clients"]): r for r in data["results"]}
    rows = []
    for (system, workload, clients), a in by_key.items():
        b = by_key.get((second, workload, clients))
        if system == first and b:
            tps = a["output_tokens_per_s"] / b["output_tokens_per_s"] if b["output_tokens_per_s"] else None
            ttft = a["ttft_p99"] / b["ttft_p99"] if a["ttft_p99"] and b["ttft_p99"] else None
            rows.append([workload, str(clients), ratio(tps), ratio(ttft)])
    return rows


RENDER = {"runtime": render_runtime, "gguf": render_gguf, "build": render_build,
          "speculative": render_speculative, "kiln-bench": render_kiln_bench, "serving": render_serving,
          "attention": render_attention}


# -- the two sections ----------------------------------------------------------------------------


def benchmarks_section(results: dict[str, object]) -> str:
    lines = [STAMP, ""]
    for name, data in ordered(results):
        lines += RENDER[kind(data)](name, data)
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines)


def _short_build(system: str) -> str:
    """'kiln defaults (--quant int4): ort int4' -> '`--quant int4`: `ort` int4'."""
    s = re.sub(r"^\((.*?)\)", r"\1", re.sub(r"^kiln (defaults )?", "", system))
    flags, _, engine = s.rpartition(": ")
    flags = re.sub(r"(--\S+(?: [\w.-]+)?)", r"`\1`", flags)
    engine = re.sub(r"^(ort|openvino)\b", r"`\1`", engine)
    return f"{flags}: {engine}" if flags else engine


def _short_cpu(m: dict) -> str:
    return f"{(m['cpu'] or 'unrecorded').split(' with ')[0]}, `{m['cpu_class']}`" if m.get("cpu_class") else "unrecorded"


def readme_section(results: dict[str, object]) -> str:
    """Ratios of the builds still current, against their peers: no dates, a few figures a line."""
    rows = []
    for name, data in ordered(results):
        m, gone = meta(data), meta(data).get("superseded") or {}
        if kind(data) == "runtime":
            systems = _named(data)
            for k, p in _pairs(data):
                if k not in gone:
                    r = _ratios(systems[k], systems[p])
                    rows.append([_short_cpu(m), _short_build(k), p, f"{ratio(r[0])} the time", ratio(r[1]), ratio(r[3])])
        elif kind(data) == "gguf":
            for model in data["models"].values():
                for system, r in model["ratios_kiln_over_llamacpp"].items():
                    if system not in gone:
                        rows.append([_short_cpu(m), _short_build(system), f"llama.cpp, the same `{model['gguf']}`",
                                     f"{ratio(r['ttft_ms'])} the time", ratio(r["1-stream"]), ratio(r["32-way"])])
    return "\n".join([STAMP, *table(["CPU", "kiln build", "peer", "TTFT 512", "1 stream", "32 streams"], rows)])


def replace_between(text: str, body: str, where: str = "") -> str:
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ResultError(f"{where}: needs one {BEGIN} and one {END} after it")
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n{body}\n{END}{tail}"


def rendered(results: dict[str, object] | None = None) -> dict[Path, str]:
    """{document: its text with the current figures rendered from the JSON}."""
    results = load() if results is None else results
    return {BENCHMARKS: replace_between(BENCHMARKS.read_text(), benchmarks_section(results), "docs/benchmarks.md"),
            README: replace_between(README.read_text(), readme_section(results), "README.md")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a rendered section is out of date; write nothing")
    args = ap.parse_args(argv)
    try:
        docs = rendered()
    except ResultError as e:
        print(e, file=sys.stderr)
        return 2
    stale = [p for p, text in docs.items() if p.read_text() != text]
    if args.check:
        for p in stale:
            print(f"{p.relative_to(ROOT)} is out of date: run python -m bench.render_results", file=sys.stderr)
        return 1 if stale else 0
    for p in stale:
        p.write_text(docs[p])
        print(f"wrote {p.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
