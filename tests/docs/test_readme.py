"""The README is for users: short, with an install section that matches pyproject.toml and the set-up
scripts, and a quick start whose commands exist as shown (build with the defaults, serve, then curl
and the openai client against what the server really serves). The checks every document shares
(commands, options, links, metrics) are in test_docs.py."""

from __future__ import annotations

import json
import re
import shlex

import pytest

from test_docs import FENCE, ROOT, _api_routes, code_blocks, command_problems, kiln_invocations, shell_lines

README = (ROOT / "README.md").read_text()
MAX_LINES = 250
QUICK_START_MAX_LINES = 30


def section(title: str) -> str:
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", README, re.S | re.M)
    assert m, f"the README has no '## {title}' section"
    return m.group(1)


def test_the_readme_is_short():
    assert len(README.splitlines()) <= MAX_LINES


def test_the_first_screen_says_what_kiln_is_then_how_to_install():
    headings = re.findall(r"^## (.+)$", README, re.M)
    assert headings[:2] == ["Install", "Quick start"], headings
    intro = README.split("\n## ")[0].split("\n", 1)[1].strip()
    sentences = re.findall(r"[^.]+\.(?:\s|$)", intro.replace("\n", " "))
    assert 2 <= len(sentences) <= 4, f"the introduction should be 2-4 sentences, it has {len(sentences)}"


def test_the_install_section_names_every_extra_and_both_scripts():
    tomllib = pytest.importorskip("tomllib")     # Python 3.11+
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    install = section("Install")
    missing = [e for e in extras if f"| `{e}` |" not in install]
    assert not missing, f"the README's install table lacks the extras {missing}"
    for script in ("scripts/demo.sh", "scripts/test.sh"):
        assert (ROOT / script).exists(), f"{script} is gone"
        assert f"bash {script}" in install, f"the install section does not show `bash {script}`"


def test_the_demo_quant_override_is_documented_while_the_script_has_it():
    demo = (ROOT / "scripts" / "demo.sh").read_text()
    if "QUANT" in demo:
        assert "QUANT=" in section("Install"), "scripts/demo.sh reads QUANT; the README should say so"
    else:
        assert "QUANT=" not in README, "the README documents a QUANT override scripts/demo.sh no longer has"


def _quick_start() -> str:
    text = section("Quick start")
    assert len(text.strip().splitlines()) < QUICK_START_MAX_LINES, "the quick start is over 30 lines"
    return text


def test_the_quick_start_builds_with_the_defaults_then_serves():
    commands = [(sub, tokens) for sub, tokens, _ in kiln_invocations(_quick_start())]
    assert [sub for sub, _ in commands] == ["build", "serve"], commands
    (_, build), (_, serve) = commands
    assert build == ["smollm2-135m", "--out", "engines/smollm2"], "the quick start builds with no backend/quant flags"
    for sub, tokens in commands:
        assert command_problems(sub, tokens) == [], command_problems(sub, tokens)
    assert serve[0] == "engines/smollm2", "the quick start serves the artifact it built"


def test_the_quick_start_calls_what_the_server_serves():
    text = _quick_start()
    (_, serve), = [(sub, t) for sub, t, _ in kiln_invocations(text) if sub == "serve"]
    port = serve[serve.index("--port") + 1] if "--port" in serve else "8000"
    model = serve[0].rstrip("/").rsplit("/", 1)[-1]     # the served model id: the folder's name

    (curl,) = [line for line in shell_lines(text) if line.startswith("curl")]
    args = shlex.split(curl)
    url = next(a for a in args if a.startswith("http"))
    assert url.startswith(f"http://127.0.0.1:{port}/"), url
    path = "/" + url.split("/", 3)[3]
    assert path in _api_routes(), f"the quick start's curl calls {path}, which kiln serve does not serve"
    body = json.loads(args[args.index("-d") + 1])
    assert body["model"] == model and body["messages"], body

    (client,) = code_blocks(text, ("python",))
    assert "from openai import OpenAI" in client
    assert f'base_url="http://127.0.0.1:{port}/v1"' in client
    assert f'model="{model}"' in client
    assert "chat.completions.create" in client


# -- the README's tables hold one-line answers; measurements live in docs/benchmarks.md ------------

CELL_MAX = 160                      # characters of one table cell, markup included
CELL_MAX_BY_SECTION = {"Documentation": 210}   # its Deployment row is 203 today; shorten it, then drop this
RATIOS_PER_CELL = 4
DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")


def _table_cells() -> list[tuple[str, str]]:
    """(section title, cell text) of every table row in the README outside code blocks."""
    cells, title = [], "(top)"
    for line in FENCE.sub("", README).splitlines():
        if line.startswith("## "):
            title = line[3:].strip()
        elif line.startswith("|") and not re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", line.strip()):
            # split on pipes outside inline code
            parts = re.split(r"\|(?=(?:[^`]*`[^`]*`)*[^`]*$)", line.strip())[1:-1]
            cells += [(title, c.strip()) for c in parts]
    return cells


def test_readme_table_cells_are_one_line_answers():
    cells = _table_cells()
    assert len(cells) > 20, "the table parser found no tables"
    long = [f"{title}: {len(c)} characters: {c[:80]}…" for title, c in cells
            if len(c) > CELL_MAX_BY_SECTION.get(title, CELL_MAX)]
    assert not long, ("README table cells over the bound (move the measured detail to docs/benchmarks.md):\n"
                      + "\n".join(long))
    crowded = [c for _, c in cells if len(re.findall(r"\d(?:\.\d+)?x\b", c)) > RATIOS_PER_CELL]
    assert not crowded, f"cells with more than {RATIOS_PER_CELL} ratios: {crowded}"


def test_readme_has_no_dates_outside_links():
    """Dates belong to measurements, and measurements to docs/benchmarks.md and its journal."""
    text = re.sub(r"\]\([^)]*\)", "]()", FENCE.sub("", README))
    assert not DATE.findall(text), f"the README states dates (keep them in docs/benchmarks.md): {DATE.findall(text)}"


def test_which_build_to_choose_is_goal_flags_trade_off():
    text = section("Which build to choose")
    assert "| goal | build flags | trade-off |" in text
    assert "(docs/benchmarks.md" in text, "the section links the measured detail in docs/benchmarks.md"


def test_the_checks_catch_a_long_cell_and_a_date():
    assert len(re.split(r"\|(?=(?:[^`]*`[^`]*`)*[^`]*$)", "| a | `x|y` | c |")[1:-1]) == 3
    assert DATE.search("measured 2026-12-04") and not DATE.search(re.sub(r"\]\([^)]*\)", "]()", "[j](r/2026-12-04.md)"))
