"""The current figures come from bench/results/*.json, and the journal keeps every run.

docs/benchmarks.md's "Current figures" and the README's short table are rendered by
bench/render_results.py between `<!-- results:begin -->` and `<!-- results:end -->`: re-rendered
here in memory, they must equal what the documents hold, so a new or changed result JSON fails the
suite until `python -m bench.render_results` has run. Every result says where, when and how it ran,
and names its journal entry. The journal (docs/results/*.md, one file per study) is listed on the
Benchmarks page, and its links resolve like the other documents' (test_docs.py reads docs/*.md only).
"""

from __future__ import annotations

import copy
import re

import pytest

from bench import render_results as rr
from test_docs import ROOT, link_problems, outside_problems

JOURNAL = sorted((ROOT / "docs" / "results").glob("*.md"))


def test_the_rendered_figures_are_up_to_date_with_the_json():
    for path, text in rr.rendered().items():
        assert path.read_text() == text, (
            f"{path.relative_to(ROOT)} differs from what bench/results/*.json gives: run python -m bench.render_results")
    assert rr.main(["--check"]) == 0


def test_every_result_says_where_when_and_how_it_ran():
    results = rr.load()
    assert {"runtime.json", "gguf_peers.json", "build.json"} <= set(results), sorted(results)
    problems = [p for name, data in results.items() for p in rr.problems(name, data)]
    assert not problems, "\n".join(problems)
    for name, data in results.items():
        m = rr.meta(data)
        assert m["command"].startswith(("python -m bench.", "kiln ")), f"{name}: command {m['command']!r}"
        for system in m.get("superseded") or {}:
            assert system in _systems(data), f"{name}: superseded names {system!r}, which the run does not hold"


def _systems(data) -> set[str]:
    if rr.kind(data) == "runtime":
        return set(rr._named(data))
    if rr.kind(data) == "gguf":
        return {s for model in data["models"].values() for s in model["systems"]}
    return set()


def test_a_new_result_changes_the_rendering_so_the_suite_notices():
    results = rr.load()
    before = rr.benchmarks_section(results), rr.readme_section(results)
    amx = copy.deepcopy(results["runtime.json"])
    amx.update(cpu="Intel Xeon with AMX", cpu_class="amx", date="2099-01-01", superseded={})
    results["runtime-amx.json"] = amx
    after = rr.benchmarks_section(results), rr.readme_section(results)
    assert after[0] != before[0] and "Intel Xeon with AMX" in after[0]
    assert after[1] != before[1] and "Intel Xeon" in after[1]
    assert after[0].index("[runtime-amx.json]") < after[0].index("[runtime.json]"), "the newest run comes first"


def test_a_result_it_cannot_render_fails_with_what_to_do():
    results = rr.load()
    bare = {k: v for k, v in results["runtime.json"].items() if k not in ("cpu", "command")}
    with pytest.raises(rr.ResultError, match=r"runtime-new.json: add \['cpu', 'command'\]"):
        rr.benchmarks_section({**results, "runtime-new.json": bare})
    odd = {**{k: results["build.json"][0][k] for k in rr.REQUIRED}, "something": 1}
    with pytest.raises(rr.ResultError, match="no renderer knows this shape"):
        rr.benchmarks_section({**results, "odd.json": odd})
    with pytest.raises(rr.ResultError, match="cpu_class"):
        rr.benchmarks_section({**results, "runtime-x.json": {**results["runtime.json"], "cpu_class": "avx-9000"}})
    with pytest.raises(rr.ResultError, match="needs one"):
        rr.replace_between("no markers here", "body", "doc")


def test_the_readme_leaves_out_superseded_builds_and_dates():
    results = rr.load()
    section = rr.readme_section(results)
    assert "superseded" not in section
    assert not re.search(r"\d{4}-\d{2}-\d{2}", section)
    for name, data in results.items():
        if isinstance(data, dict) and data.get("superseded") and rr.kind(data) in ("runtime", "gguf"):
            kept = rr.readme_section({**results, name: {**data, "superseded": {}}})
            assert kept.count("\n") > section.count("\n"), f"{name}: its superseded builds still reach the README"


META = {"date": "2026-01-02", "time_utc": "10:00–10:10", "cpu": "Some CPU with AVX2", "cpu_class": "avx2",
        "command": "python -m bench.bench_build", "journal": "docs/results/" + JOURNAL[0].name}


def _system(name, ttft, one, eight, way32, answer="The capital of France is Paris."):
    return {"name": name, "chat_answer": answer,
            "metrics": {"ttft_ms": ttft, "1-stream": one, "8-way": eight, "32-way": way32}}


def test_the_arithmetic_on_made_up_runs():
    runtime = {**META, "superseded": {"kiln old": "replaced"}, "systems": {
        "a": _system("kiln new", 200.0, 120.0, 600.0, 1200.0), "b": _system("peer", 400.0, 100.0, 500.0, 1000.0),
        "c": _system("kiln old", 1000.0, 50.0, 100.0, 250.0, answer="L'Étoile")}, "targets": [
        {"metric": "32-way", "kiln_name": "kiln new", "peer_name": "peer", "kiln": 1200.0, "peer": 1000.0, "unit": "tok/s",
         "target": 1.2, "higher_is_better": True, "met": True, "ratio": 1.2},
        {"metric": "32-way", "kiln_name": "kiln old", "peer_name": "peer", "kiln": 250.0, "peer": 1000.0, "unit": "tok/s",
         "target": 1.2, "higher_is_better": True, "met": False, "ratio": 0.25}]}
    build = [{**META, "mode": "none", "build_seconds": 100.0, "bytes": 400e6, "perplexity": 20.0},
             {**META, "mode": "int8", "build_seconds": 50.0, "bytes": 100e6, "perplexity": 20.2}]
    results = {"runtime-x.json": runtime, "build-x.json": build}
    page = rr.benchmarks_section(results)
    assert "| kiln new | 200 ms | 120.0 tok/s | 600 | 1,200 | Paris |" in page
    assert "| kiln new | peer | 0.50x | 1.20x | 1.20x | 1.20x |" in page
    assert "| kiln old (superseded) | 1,000 ms | 50.0 tok/s | 100 | 250 | no (“L'Étoile”) |" in page
    assert "| 32-way, kiln new / peer | ≥ 1.2x | 1.20x | met |" in page
    # a file that records its question's expected word is read by it; one without asked for Paris
    tokyo = {**runtime, "superseded": {}, "targets": [], "chat_expects": "Tokyo", "systems": {
        "a": _system("kiln new", 200.0, 120.0, 600.0, 1200.0, answer="The capital of Japan is Tokyo."),
        "b": _system("peer", 400.0, 100.0, 500.0, 1000.0)}}
    tokyo_page = rr.benchmarks_section({"runtime-x.json": tokyo})
    assert "| kiln new | 200 ms | 120.0 tok/s | 600 | 1,200 | Tokyo |" in tokyo_page
    assert "| peer | 400 ms | 100.0 tok/s | 500 | 1,000 | no (“The capital of France is Paris.”) |" in tokyo_page
    assert "| int8 | 50 s | 100 MB | 0.250 | 20.200 | +1.00 % |" in page
    assert "2026-01-02 10:00–10:10 UTC, Some CPU with AVX2 (class `avx2`)" in page
    readme = rr.readme_section(results)
    assert "| Some CPU, `avx2` | new | peer | 0.50x the time | 1.20x | 1.20x |" in readme
    assert "old" not in readme and "2026" not in readme


# -- the journal -------------------------------------------------------------------------------


def test_the_journal_entries_are_dated_titled_and_listed_on_the_benchmarks_page():
    assert JOURNAL, "docs/results/ holds no journal entry"
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    for entry in JOURNAL:
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}-[a-z0-9-]+\.md", entry.name), f"{entry.name}: name it YYYY-MM-DD-study.md"
        lines = entry.read_text().splitlines()
        assert lines[0].startswith("# ") and not lines[1].strip() and lines[2].strip(), (
            f"{entry.name}: a title, a blank line, a purpose")
        assert f"(results/{entry.name}" in page, f"docs/benchmarks.md's journal does not list {entry.name}"


@pytest.mark.parametrize("entry", JOURNAL, ids=lambda p: p.name)
def test_the_journal_links_resolve_inside_the_repository(entry):
    text = entry.read_text()
    problems = link_problems(entry, text) + outside_problems(entry, text)
    assert not problems, "\n".join(problems)


def test_every_result_names_a_journal_entry_that_exists():
    for name, data in rr.load().items():
        journal = rr.meta(data)["journal"]
        path, _, anchor = journal.partition("#")
        assert (ROOT / path).is_file(), f"{name}: {path}"
        assert not link_problems(ROOT / "README.md", f"[j]({journal})"), f"{name}: {journal} has no such heading"
