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
