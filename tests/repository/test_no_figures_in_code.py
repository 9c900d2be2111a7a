"""No comment or docstring under kiln/ holds a date or a measured figure (issue 42).

Code comments say why; the numbers behind a decision, and when and where they were measured, go to
the append-only journal under docs/results/, which a comment may link. This scans the prose only:
Python comments (tokenize) and docstrings (ast: the first statement of a module, class or function),
and C++ `//` and `/* */` comments. Numbers in code (constants, defaults) are code, not prose.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KILN = ROOT / "kiln"

_MONTH = (
    r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?"
    r"|Sep(?:t(?:ember)?)?|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)"
)
_NUM = r"(?<![\w.])\d+(?:[.,]\d+)?"
# Each pattern names what it found; all are matched against comment or docstring text only.
PATTERNS = {
    "date": re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b"),
    "month and day": re.compile(rf"\b{_MONTH}\.? \d{{1,2}}(?:st|nd|rd|th)?\b(?!\.\d)"),
    # a duration: "42 ms", "2.5 us", "3.2 µs" (a bare "s" is left alone: timeouts and defaults)
    "duration": re.compile(rf"{_NUM} ?(?:ms|µs|us|ns)\b"),
    # a rate: "66.5 tok/s", "12 tokens/s", "40 GB/s"
    "rate": re.compile(rf"{_NUM} ?(?:tok/s|tokens/s|tokens per second|[KMG]i?B/s)"),
    # a ratio: "1.3x", "0.93×", "~2x faster"; not a shape or a product ("576x3072", "8 x 3")
    "ratio": re.compile(rf"{_NUM}(?:-\d+(?:\.\d+)?)?(?: ?×|x(?!\w))(?! ?\d)"),
    # a percentage told as a gain or a loss: "3 % faster", "+2.7 %", "-18%"
    "percent": re.compile(
        rf"(?:{_NUM} ?% (?:faster|slower|quicker|cheaper|more|less|fewer)\b"
        r"|(?<![\w.])[+\u2212-]\d+(?:\.\d+)? ?%)"
    ),
}

# Known hits, each (path under the repository, a snippet of the comment line's text). Remove an
# entry once its comment no longer holds the figure: a stale entry fails the test too.
ALLOWED: set[tuple[str, str]] = set()      # (path, snippet) of a comment that may keep a figure


def _python_prose(path: Path) -> list[tuple[int, str]]:
    source = path.read_text(encoding="utf-8")
    prose: list[tuple[int, str]] = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            prose.append((tok.start[0], tok.string))
    for node in ast.walk(ast.parse(source, filename=str(path))):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        first = node.body[0] if node.body else None
        if (
            isinstance(first, ast.Expr)
            and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)
        ):
            # the docstring's own lines, numbered from its opening quote
            for i, line in enumerate(first.value.value.splitlines()):
                prose.append((first.lineno + i, line))
    return prose


def _cpp_prose(path: Path) -> list[tuple[int, str]]:
    """`//` and `/* */` comments, line by line; string literals are not parsed (kiln's have no `//`)."""
    prose: list[tuple[int, str]] = []
    in_block = False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        text, i = "", 0
        while i < len(line):
            if in_block:
                end = line.find("*/", i)
                if end < 0:
                    text += line[i:]
                    break
                text += line[i:end] + " "
                i, in_block = end + 2, False
                continue
            starts = [j for j in (line.find("//", i), line.find("/*", i)) if j >= 0]
            if not starts:
                break
            j = min(starts)
            if line.startswith("//", j):
                text += line[j + 2 :]
                break
            i, in_block = j + 2, True
        if text.strip():
            prose.append((number, text))
    return prose


def _sources() -> list[Path]:
    return sorted(p for p in KILN.rglob("*") if p.suffix in (".py", ".cc", ".h") and p.is_file())


# A link to a journal entry names its day; the link is what a comment should hold, so it is not prose.
_JOURNAL_LINK = re.compile(r"(?:docs/)?results/[\w./#-]+")


def find_figures() -> list[tuple[str, int, str, str]]:
    """(path, line, what, text) for every comment or docstring line that holds a date or a figure."""
    hits = []
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        prose = _python_prose(path) if path.suffix == ".py" else _cpp_prose(path)
        for number, text in prose:
            bare = _JOURNAL_LINK.sub("", text)
            for what, pattern in PATTERNS.items():
                if pattern.search(bare):
                    hits.append((rel, number, what, text.strip()))
                    break
    return hits


def _allowed(rel: str, text: str) -> tuple[str, str] | None:
    for entry in ALLOWED:
        if entry[0] == rel and entry[1] in text:
            return entry
    return None


def test_no_dates_or_measured_figures_in_comments():
    hits = find_figures()
    bad = [f"{rel}:{n}: [{what}] {text}" for rel, n, what, text in hits if not _allowed(rel, text)]
    assert not bad, (
        "comments and docstrings say why, not how much or when: move the figure or date to a "
        "docs/results/ journal entry and link it\n" + "\n".join(bad)
    )


def test_allow_list_has_no_stale_entries():
    used = {_allowed(rel, text) for rel, _, _, text in find_figures()}
    stale = sorted(ALLOWED - used)
    assert not stale, f"these comments no longer hold a figure; drop them from ALLOWED: {stale}"


def test_patterns_catch_figures_and_leave_code_words_alone():
    def caught(text: str) -> bool:
        return any(p.search(_JOURNAL_LINK.sub("", text)) for p in PATTERNS.values())

    for text in (
        "# kiln's kernel is 1.3x faster here",
        "# measured 42 ms a step",
        "# on the EPYC 2026-11-30",
        "# 66.5 tok/s at one stream",
        "# 3 % faster calls than into L2",
        "# (was 120 ms)",
        "# run on Nov 30",
        "# perplexity +2.73 % over fp32",
        "# 0.93-0.99x the time",
        "# 2.5 us against 3.2 µs",
    ):
        assert caught(text), text
    for text in (
        "# a 576x3072 matmul",
        "# up to 8 x 3 int32 sums",
        "# 128 x the column's sum of codes",
        "# timeouts in seconds",
        "# Retry-After is 1 s at least",
        "# a u8 x s8 dot product",
        "# 4 chat streams",
        "# may 3 tokens be enough",
        "# figures: docs/results/2026-12-06-figures-from-code-comments.md",
    ):
        assert not caught(text), text
