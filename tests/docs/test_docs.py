"""The documents (README.md and docs/*.md) against the code they describe.

Every `kiln` command and option they show, in code blocks and in inline code, exists in the click
CLI (kiln/cli.py) with a value its choices allow; every script they run (bench/, scripts/, the
Triton launcher) exists and takes the options shown; every relative link resolves to a file in the
repository, anchors included; nothing points outside the repository; the metric table lists every
metric kiln exports; the Python examples parse and their kiln imports resolve. Each checker is
also shown to fail on a made-up input, so a passing run means something.
"""

from __future__ import annotations

import ast
import importlib
import re
import shlex
from functools import lru_cache
from pathlib import Path

import click
import pytest

ROOT = Path(__file__).parents[2]
DOC_PATHS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DOCS = {p: p.read_text() for p in DOC_PATHS}
REQUIRED_PAGES = ("install", "models", "building", "serving", "metrics", "python-api", "speculative",
                  "triton", "gpu", "deployment", "benchmarks", "architecture")
TRITON_LAUNCHER = "kiln.serving.triton.launch"


def _doc_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


# -- reading documents -------------------------------------------------------------------------

FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```", re.S | re.M)


def code_blocks(text: str, langs: tuple[str, ...] | None = None) -> list[str]:
    return [body for lang, body in FENCE.findall(text) if langs is None or lang in langs]


def prose(text: str) -> str:
    """The text outside fenced code blocks."""
    return FENCE.sub("", text)


def inline_code(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", prose(text))


def shell_lines(text: str) -> list[str]:
    """Logical command lines of the shell blocks: continuations joined, comments dropped, `a && b` split."""
    lines = []
    for block in code_blocks(text, ("bash", "sh", "shell", "console")):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in _logical_lines(joined):
            for part in re.split(r"\s(?:&&|;|\|\|)\s", _strip_comment(line)):
                if part.strip():
                    lines.append(part.strip().rstrip("&").strip())
    return lines


def _logical_lines(block: str) -> list[str]:
    """Lines, with a quoted string that spans lines kept in one (as bash reads it)."""
    out, current = [], ""
    for line in block.splitlines():
        current = f"{current}\n{line}" if current else line
        try:
            shlex.split(current, comments=True)
        except ValueError:          # an open quote: the command goes on
            continue
        out.append(current)
        current = ""
    if current:
        out.append(current)
    return out


def _strip_comment(line: str) -> str:
    """Drop a trailing `# comment` that is not inside quotes."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def _tokens(command: str) -> list[str]:
    try:
        return shlex.split(command)
    except ValueError:
        return command.split()


# -- kiln commands -----------------------------------------------------------------------------

KILN = re.compile(r"(?:^|\s)(?:\S*/)?kiln\s+([a-z][a-z-]*)((?:\s.*)?)$")


def kiln_invocations(text: str) -> list[tuple[str, list[str], str]]:
    """(subcommand, the tokens after it, the source line) of every `kiln ...` a document shows."""
    found = []
    for line in shell_lines(text) + [s for s in inline_code(text) if s.startswith("kiln ")]:
        m = KILN.search(line)
        if m:
            found.append((m.group(1), _tokens(m.group(2)), line))
    return found


@lru_cache(maxsize=1)
def cli() -> click.Group:
    from kiln.cli import main

    return main


def _is_placeholder(value: str) -> bool:
    """KEY, PATH, "$KEY", ...: a value the reader fills in, not one to check against the choices."""
    return not value or value != value.lower() or any(c in value for c in "$<>…") or value == "..."


def _choice_problems(param: click.Parameter, value: str, where: str) -> list[str]:
    if not isinstance(param.type, click.Choice):
        return []
    bad = [v for v in value.split("|") if not _is_placeholder(v) and v not in param.type.choices]
    return [f"{where}: {param.opts[0]} {v!r} is not one of {list(param.type.choices)}" for v in bad]


def command_problems(sub: str, tokens: list[str], where: str = "") -> list[str]:
    """What is wrong with `kiln SUB TOKENS...` against the real CLI: an unknown subcommand or
    option, or an option value outside its choices. [] when it is right."""
    where = where or f"kiln {sub} {' '.join(tokens)}"
    command = cli().commands.get(sub)
    if command is None:
        return [f"{where}: the CLI has no `kiln {sub}` (it has {sorted(cli().commands)})"]
    params = {opt: p for p in command.params for opt in p.opts}
    problems, i = [], 0
    tokens = [t for t in tokens if t not in ("[", "]")]
    while i < len(tokens):
        token = tokens[i].strip("[]")
        i += 1
        if not token.startswith("-") or token == "-":
            continue
        name, _, inline_value = token.partition("=")
        param = params.get(name)
        if param is None:
            problems.append(f"{where}: `kiln {sub}` has no option {name}")
            continue
        if isinstance(param, click.Option) and (param.is_flag or param.count):
            continue
        value = inline_value
        if not value and i < len(tokens) and not tokens[i].startswith("-"):
            value = tokens[i].strip("[]")
            i += 1
        problems += _choice_problems(param, value, where)
    return problems


def bare_option_problems(span: str, where: str) -> list[str]:
    """An inline `--option [value]` on its own: it must be an option of some kiln command (with a
    value its choices allow) or of a script the documents run."""
    name, value = re.match(r"(--[a-z][a-z0-9-]*)(?:[ =](\S+))?", span).groups()
    holders = [p for c in cli().commands.values() for p in c.params if name in p.opts]
    if not holders:
        if name in script_options_anywhere():
            return []
        return [f"{where}: no kiln command (or script) has the option {name}"]
    if value and all(isinstance(p.type, click.Choice) for p in holders):
        if all(_choice_problems(p, value, where) for p in holders):
            return _choice_problems(holders[0], value, where)
    return []


# -- scripts the documents run -----------------------------------------------------------------

SCRIPT = re.compile(r"(?:^|\s)(?:\S*/)?python3?\s+(?:-m\s+((?:kiln|bench)\.[\w.]+)|((?:bench|scripts)/[\w./-]+\.py))((?:\s.*)?)$")


def script_options(source: Path) -> set[str]:
    """The --options a script defines (argparse string literals; BooleanOptionalAction adds --no-X)."""
    found = set(re.findall(r"[\"'](--[a-z][a-z0-9-]*)[\"']", source.read_text()))
    return found | {f"--no-{o[2:]}" for o in found}


def _module_file(module: str) -> Path:
    return ROOT / (module.replace(".", "/") + ".py")


@lru_cache(maxsize=1)
def script_options_anywhere() -> frozenset[str]:
    paths = [*(ROOT / "bench").glob("*.py"), *(ROOT / "scripts").glob("*.py"), _module_file(TRITON_LAUNCHER)]
    return frozenset(o for p in paths if p.exists() for o in script_options(p))


def script_problems(line: str, where: str) -> list[str]:
    m = SCRIPT.search(line)
    if not m:
        return []
    module, script, rest = m.groups()
    path = _module_file(module) if module else ROOT / script
    if not path.exists():
        return [f"{where}: {module or script} does not exist in the repository"]
    known = script_options(path)
    return [f"{where}: {path.relative_to(ROOT)} has no option {t.split('=')[0]}"
            for t in _tokens(rest) if t.startswith("--") and t.split("=")[0] not in known]


# -- links -------------------------------------------------------------------------------------

LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*|_(?=\w)|(?<=\w)_", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", prose(text), re.M):
        s = slug(heading)
        n = seen.get(s, 0)
        out.add(s if n == 0 else f"{s}-{n}")
        seen[s] = n + 1
    return out


def link_problems(doc: Path, text: str) -> list[str]:
    problems = []
    for target in LINK.findall(prose(text)):
        where = f"{_doc_id(doc)}: link ({target})"
        if re.match(r"https?://", target) or target.startswith("mailto:"):
            continue
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith(("/", "~", "\\")):
            problems.append(f"{where} is an absolute path or a local URL, not a link inside the repository")
            continue
        path_part, _, anchor = target.partition("#")
        resolved = (doc.parent / path_part).resolve() if path_part else doc
        if not resolved.is_relative_to(ROOT.resolve()):
            problems.append(f"{where} leaves the repository")
            continue
        if not resolved.exists():
            problems.append(f"{where} names a file that does not exist")
            continue
        if anchor and resolved.suffix == ".md" and anchor not in anchors(resolved.read_text()):
            problems.append(f"{where}: {resolved.name} has no heading #{anchor}")
    return problems


OUTSIDE = re.compile(r"(?<![\w.~-])(?:/work/|/home/|/root/|/mnt/|file://)\S*|\bshared/(?:notes|design)\S*|\bnotes/\S*"
                     r"|\bARCHITECTURE\.md\b")


def outside_problems(doc: Path, text: str) -> list[str]:
    problems = [f"{_doc_id(doc)} points outside the repository: {m}" for m in OUTSIDE.findall(text)]
    for m in re.findall(r"(?:\.\./)+[\w.-][\w./-]*", text):
        if not (doc.parent / m).resolve().is_relative_to(ROOT.resolve()):
            problems.append(f"{_doc_id(doc)} points outside the repository: {m}")
    return problems


# -- the tests ---------------------------------------------------------------------------------


def test_every_page_exists_starts_with_its_purpose_and_is_linked_from_the_readme():
    readme = DOCS[ROOT / "README.md"]
    for name in REQUIRED_PAGES:
        page = ROOT / "docs" / f"{name}.md"
        assert page.exists(), f"docs/{name}.md is missing"
        lines = DOCS[page].splitlines()
        assert lines[0].startswith("# ") and not lines[1].strip(), f"docs/{name}.md: a title, then a blank line"
        assert lines[2].strip() and not lines[3].strip(), f"docs/{name}.md: the title is followed by a one-line purpose"
        assert f"(docs/{name}.md)" in readme, f"the README does not link docs/{name}.md"


@pytest.mark.parametrize("doc", DOC_PATHS, ids=_doc_id)
def test_every_kiln_command_exists_with_its_options(doc):
    problems = [p for sub, tokens, line in kiln_invocations(DOCS[doc])
                for p in command_problems(sub, tokens, f"{_doc_id(doc)}: {line}")]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("doc", DOC_PATHS, ids=_doc_id)
def test_every_option_named_alone_exists(doc):
    spans = [s for s in inline_code(DOCS[doc]) if re.match(r"--[a-z]", s)]
    problems = [p for s in spans for p in bare_option_problems(s, f"{_doc_id(doc)}: `{s}`")]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("doc", DOC_PATHS, ids=_doc_id)
def test_every_script_run_exists_with_its_options(doc):
    lines = shell_lines(DOCS[doc]) + inline_code(DOCS[doc])
    problems = [p for line in lines for p in script_problems(line, f"{_doc_id(doc)}: {line}")]
    assert not problems, "\n".join(problems)


def test_the_documents_show_every_subcommand():
    shown = {sub for text in DOCS.values() for sub, _, _ in kiln_invocations(text)}
    assert shown >= set(cli().commands), f"no document shows: {sorted(set(cli().commands) - shown)}"


# Each command's options are all documented on its page (runtime options on the serving page).
OPTION_PAGES = {"build": "building", "inspect": "building", "serve": "serving", "generate": "serving",
                "triton-repo": "triton", "bench": "benchmarks"}


@pytest.mark.parametrize("sub", sorted(OPTION_PAGES))
def test_every_option_of_a_command_is_documented_on_its_page(sub):
    page = DOCS[ROOT / "docs" / f"{OPTION_PAGES[sub]}.md"] + DOCS[ROOT / "docs" / "serving.md"]
    documented = set(re.findall(r"`(--[a-z][a-z0-9-]*)", page))
    options = [p.opts[0] if p.opts[0].startswith("--") else p.opts[-1]
               for p in cli().commands[sub].params if isinstance(p, click.Option)]
    missing = [o for o in options if o.startswith("--") and o not in documented]
    assert not missing, f"docs/{OPTION_PAGES[sub]}.md does not document `kiln {sub}` {missing}"


@pytest.mark.parametrize("doc", DOC_PATHS, ids=_doc_id)
def test_every_relative_link_resolves_inside_the_repository(doc):
    problems = link_problems(doc, DOCS[doc])
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("doc", DOC_PATHS, ids=_doc_id)
def test_no_reference_outside_the_repository(doc):
    problems = outside_problems(doc, DOCS[doc])
    assert not problems, "\n".join(problems)


def test_module_paths_are_named_only_in_the_architecture_page():
    """Users read commands, options and public imports; where the code lives is for contributors."""
    for doc, text in DOCS.items():
        if doc.name == "architecture.md":
            continue
        paths = re.findall(r"\bkiln/[\w/]+\.py\b", text)
        assert not paths, f"{_doc_id(doc)} names module paths (keep them to docs/architecture.md): {paths}"


def test_architecture_names_only_modules_that_exist():
    text = DOCS[ROOT / "docs" / "architecture.md"]
    named = set(re.findall(r"`(kiln/[\w/.]+)`", text))
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


def _api_routes() -> set[str]:
    sources = [ROOT / "kiln/serving/http/app.py", ROOT / "kiln/serving/console/routes.py",
               ROOT / "kiln/serving/http/utility_routes.py"]
    return {r for s in sources for r in re.findall(r"Route\(\"([^\"]+)\"", s.read_text())}


def test_every_http_endpoint_shown_is_served():
    routes = _api_routes()
    assert {"/v1/chat/completions", "/metrics", "/"} <= routes, "the route parser found no routes"
    problems = []
    for doc, text in DOCS.items():
        if doc.name == "triton.md":             # Triton's own endpoints, on its own ports
            continue
        paths = [m for s in inline_code(text) for m in re.findall(r"^(?:GET|POST) (/\S*)$", s)]
        paths += re.findall(r"(?:127\.0\.0\.1|localhost):8000(/(?:[a-z][\w/.-]*)?)", text)
        problems += [f"{_doc_id(doc)}: {p}" for p in paths
                     if p.rstrip(".") not in routes and not p.startswith("/v2/") and p != "/v1"]
    assert not problems, "endpoints kiln serve does not have: " + ", ".join(problems)


@pytest.mark.parametrize("doc", DOC_PATHS, ids=_doc_id)
def test_python_examples_parse_and_their_kiln_imports_resolve(doc):
    for block in code_blocks(DOCS[doc], ("python",)):
        tree = ast.parse(block)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "kiln":
                module = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(module, alias.name), f"{_doc_id(doc)}: {node.module} has no {alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "kiln":
                        importlib.import_module(alias.name)


def test_the_extras_named_exist_and_every_extra_is_described():
    tomllib = pytest.importorskip("tomllib")     # Python 3.11+
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    for doc, text in DOCS.items():
        for group in re.findall(r"\.\[([\w,-]+)\]", text):
            unknown = set(group.split(",")) - extras
            assert not unknown, f"{_doc_id(doc)} installs extras pyproject.toml lacks: {unknown}"
    install = DOCS[ROOT / "docs" / "install.md"]
    missing = [e for e in extras if f"| `{e}` |" not in install]
    assert not missing, f"docs/install.md's table does not describe the extras {missing}"


# -- metrics -----------------------------------------------------------------------------------

METRICS_PAGE = DOCS[ROOT / "docs" / "metrics.md"]


def _metric_rows() -> list[list[str]]:
    return [[c.strip() for c in line.split("|")[1:-1]]
            for line in METRICS_PAGE.splitlines() if line.startswith("| `kiln_")]


def test_metric_table_lists_every_engine_metric_for_both_front_ends():
    from kiln.serving import engine_metrics as em

    both = " ".join(r[0] for r in _metric_rows() if r[2] == "both")
    for metric in (*em.GAUGES, *em.COUNTERS, em.FINISHED, em.BATCH_SIZE):
        assert f"`{metric.name}" in both, f"{metric.name} is missing from docs/metrics.md's table (as `both`)"


def test_metric_table_lists_every_metric_the_server_exports():
    names = set()
    for source in (ROOT / "kiln" / "serving").rglob("*.py"):
        names |= set(re.findall(r"[\"'](kiln_[a-z_]+)[\"']", source.read_text()))
    listed = {n.removesuffix("_total") for r in _metric_rows() for n in re.findall(r"`(kiln_[a-z_]+)", r[0])}
    missing = sorted(n for n in names if n.removesuffix("_total") not in listed)
    assert names and not missing, f"docs/metrics.md's table lacks {missing}"


# -- the checkers can fail ---------------------------------------------------------------------


def test_the_command_checker_rejects_what_the_cli_does_not_have():
    assert command_problems("build", ["smollm2-135m", "--out", "x", "--quant", "int8"]) == []
    assert command_problems("build", ["smollm2-135m", "--out", "x", "--turbo"])
    assert command_problems("build", ["smollm2-135m", "--out", "x", "--quant", "int3"])
    assert command_problems("serve", ["x", "--policy", "fastest"])
    assert command_problems("compile", ["x"])
    assert command_problems("serve", ["x", "--log-level", "debug", "--no-console"]) == []
    text = "```bash\nkiln build m --out x \\\n    --made-up-option 1   # a comment --not-an-option\n```\n"
    ((sub, tokens, _),) = kiln_invocations(text)
    assert command_problems(sub, tokens) and all("--not-an-option" not in p for p in command_problems(sub, tokens))
    assert kiln_invocations("Run `kiln inspect engines/x --jsn`.")[0][1] == ["engines/x", "--jsn"]
    assert bare_option_problems("--kv-dtype fp16", "t") == []
    assert bare_option_problems("--kv-dtype fp64", "t")
    assert bare_option_problems("--warp-speed", "t")


def test_the_script_checker_rejects_missing_scripts_and_options():
    assert script_problems("python -m bench.bench_build --modes none,int8", "t") == []
    assert script_problems("python -m bench.bench_build --turbo", "t")
    assert script_problems("python -m bench.no_such_script", "t")
    assert script_problems(f"python -m {TRITON_LAUNCHER} repo --print-command", "t") == []
    assert script_problems(f"python -m {TRITON_LAUNCHER} repo --gpus 2", "t")


def test_the_link_checker_rejects_broken_and_outside_links():
    doc = ROOT / "docs" / "page.md"
    assert link_problems(doc, "[ok](building.md#options) [up](../README.md) [web](https://example.com)") == []
    assert link_problems(doc, "[gone](no-such-page.md)")
    assert link_problems(doc, "[anchor](building.md#no-such-heading)")
    assert link_problems(doc, "[out](../../shared/notes.md)")
    assert link_problems(doc, "[abs](/work/main/README.md)")
    assert outside_problems(doc, "see ../../shared/notes/plan.md")
    assert outside_problems(doc, "see /work/main/notes.txt")
    assert outside_problems(doc, "see ../bench/README.md") == []
