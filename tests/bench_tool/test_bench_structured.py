"""The structured-output workloads of kiln bench: which requests are constrained, and real runs
in-process and against kiln serve where every request succeeds."""

from __future__ import annotations

import itertools
import json

from click.testing import CliRunner

from kiln.bench.workloads import request_specs
from kiln.cli import main

TINY_RUNTIME = ["--kv-cache-memory", "16MiB", "--threads", "1"]


def _flags(workload: str, n: int = 40) -> list[bool]:
    return [s.json_schema for s in itertools.islice(request_specs(workload, 0, 1024), n)]


def test_json_workloads_mark_their_requests():
    assert all(_flags("json")) and not any(_flags("chat"))
    mixed = _flags("json-mixed")
    assert 10 < sum(mixed) < 30 and mixed == _flags("json-mixed")      # about half, and seeded


def _run(tmp_path, *target: str, workload: str) -> list[dict]:
    out = tmp_path / f"{workload}.json"
    result = CliRunner().invoke(main, ["bench", *target, "--workload", workload, "--concurrency", "4",
                                       "--duration", "1.5", "--max-tokens", "16", "--json", str(out)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    (run,) = json.loads(out.read_text())["runs"]
    return run["levels"]


def test_json_workload_in_process(tiny_llama_artifact, tmp_path):
    (level,) = _run(tmp_path, "--engine", str(tiny_llama_artifact), *TINY_RUNTIME, workload="json")
    stats = level["stats"]
    assert stats["num_requests"] > 0 and stats["outcomes"]["ok"] == stats["num_requests"]


def test_json_mixed_workload_against_kiln_serve(tiny_serve_url, tmp_path):
    (level,) = _run(tmp_path, "--url", tiny_serve_url, workload="json-mixed")
    stats = level["stats"]
    assert stats["num_requests"] > 0 and stats["outcomes"]["ok"] == stats["num_requests"]
    assert all(r["output_tokens"] == 16 for r in level["requests"])      # constrained or not: ignore_eos
