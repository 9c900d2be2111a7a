"""The README stands on its own: it names no file outside the repository, and its metric table
lists every engine metric (the names kiln serve and the Triton backend share) as exported by both."""

from __future__ import annotations

import re
from pathlib import Path

from kiln.serving import engine_metrics as em

README = (Path(__file__).parents[2] / "README.md").read_text()


def test_no_references_outside_the_repository():
    outside = re.findall(r"(?:\.\./|shared/notes|shared/design|ARCHITECTURE\.md|/work/)\S*", README)
    assert not outside, f"the README points outside the repository: {outside}"


def test_metric_table_lists_every_engine_metric_for_both_front_ends():
    rows = [line for line in README.splitlines() if line.startswith("| `kiln_")]
    both = " ".join(r.split("|")[1] for r in rows if r.split("|")[3].strip() == "both")
    for metric in (*em.GAUGES, *em.COUNTERS, em.FINISHED, em.BATCH_SIZE):
        assert f"`{metric.name}" in both, f"{metric.name} is missing from the README's metric table"


def _readme_commands() -> list[tuple[str, list[str]]]:
    """(subcommand, options) of every `kiln ...` line in the README's shell blocks."""
    blocks = re.findall(r"```bash\n(.*?)```", README, re.S)
    lines = re.sub(r"\\\n\s*", " ", "\n".join(blocks)).splitlines()
    found = []
    for line in lines:
        m = re.match(r"\s*(?:\S*/)?kiln ([a-z-]+)(.*)", line.split("#")[0])
        if m:
            found.append((m.group(1), re.findall(r"(--[a-z][a-z-]*)", m.group(2))))
    return found


def test_every_cli_command_in_the_readme_exists_with_its_options():
    from kiln.cli import main

    commands = _readme_commands()
    assert {c for c, _ in commands} >= {"build", "inspect", "generate", "serve", "bench", "triton-repo"}
    for cmd, options in commands:
        assert cmd in main.commands, f"README shows `kiln {cmd}`, which the CLI does not have"
        known = {o for p in main.commands[cmd].params for o in p.opts}
        missing = [o for o in options if o not in known]
        assert not missing, f"README shows `kiln {cmd}` with {missing}, which it does not take"
