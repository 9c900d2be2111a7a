"""`kiln bench --export-requests`: a workload's first requests as AIPerf's single-turn JSONL, cut
with the model's tokenizer exactly as kiln bench cuts them."""

from __future__ import annotations

import itertools
import json

import pytest

from kiln.bench.export import export_requests
from kiln.bench.text import TextSource, exact_counter, render
from kiln.bench.workloads import request_specs


def test_the_file_holds_the_workload_s_requests_in_order(tiny_llama_artifact, tmp_path):
    path = tmp_path / "requests.jsonl"
    assert export_requests(path, "chat", 3, 6, str(tiny_llama_artifact), max_tokens=20) == 6
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    source = TextSource(exact_counter(str(tiny_llama_artifact)))
    specs = list(itertools.islice(request_specs("chat", 3, 2048, 20), 6))
    assert lines == [{"text": render(spec, source).user, "output_length": spec.max_tokens} for spec in specs]
    counter = exact_counter(str(tiny_llama_artifact))
    assert all(0 < counter.count(line["text"]) <= spec.prompt_tokens for line, spec in zip(lines, specs))


@pytest.mark.parametrize("workload", ["shared-prefix", "cancel", "json"])
def test_workloads_a_single_turn_line_cannot_carry_are_refused(tiny_llama_artifact, tmp_path, workload):
    with pytest.raises(ValueError, match="cannot carry"):
        export_requests(tmp_path / "x.jsonl", workload, 0, 40, str(tiny_llama_artifact))


def test_it_needs_a_count_and_a_tokenizer(tiny_llama_artifact, tmp_path):
    with pytest.raises(ValueError, match="--max-requests"):
        export_requests(tmp_path / "x.jsonl", "chat", 0, 0, str(tiny_llama_artifact))
    with pytest.raises(ValueError, match="no tokenizer.json"):
        export_requests(tmp_path / "x.jsonl", "chat", 0, 4, str(tmp_path))
