"""`kiln inspect` tells the truth about an artifact: its capacity line is the KV pool `kiln serve`
sizes by default (the runtime's own function, config and context), and its file table lists every
file in the folder with its size."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

import kiln.runtime.memory
from kiln.cli import main
from kiln.config_options import runtime_config
from kiln.contract.artifact import EngineArtifact
from kiln.inspect_view import serve_kv_plan
from kiln.units import format_bytes

AVAILABLE = 3 << 30          # what this test's machine says it has free


@pytest.fixture
def fixed_memory(monkeypatch):
    """MemAvailable moves from one read to the next; both sides read this one."""
    monkeypatch.setattr(kiln.runtime.memory, "available_memory", lambda: AVAILABLE)


def test_the_capacity_line_is_the_pool_serve_sizes(tiny_llama_artifact, fixed_memory):
    from kiln.runtime.engine_core import EngineCore

    art = EngineArtifact.load(tiny_llama_artifact)
    served = EngineCore(art, runtime_config()).plan            # what `kiln serve` builds with no options
    assert serve_kv_plan(art) == served
    assert served.context_len == art.manifest.generation["max_model_len"]
    res = CliRunner().invoke(main, ["inspect", str(tiny_llama_artifact)], terminal_width=400)
    assert res.exit_code == 0, res.output
    assert served.describe() in res.output and "what `kiln serve` sizes here by default" in res.output


def test_the_capacity_line_at_a_budget_and_context_given(tiny_llama_artifact, fixed_memory):
    art = EngineArtifact.load(tiny_llama_artifact)
    plan = serve_kv_plan(art, context_len=512, memory_bytes=1 << 20)
    assert plan.context_len == 512 and plan.num_blocks == (1 << 20) // art.manifest.kv_layout.bytes_per_block
    res = CliRunner().invoke(main, ["inspect", str(tiny_llama_artifact), "--context", "512", "--memory", "1MiB"],
                             terminal_width=400)
    assert plan.describe() in res.output and "by default" not in res.output


def test_the_file_table_lists_every_file_with_its_size(tiny_llama_artifact):
    res = CliRunner().invoke(main, ["inspect", str(tiny_llama_artifact)], terminal_width=400)
    files = sorted(p for p in tiny_llama_artifact.rglob("*") if p.is_file())
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in res.output.splitlines()
            if line.count("│") >= 4}
    for path in files:
        name = str(path.relative_to(tiny_llama_artifact))
        assert rows.get(name) == format_bytes(path.stat().st_size), name
    assert rows["total"] == format_bytes(sum(p.stat().st_size for p in files))
    assert {"engines/ort/model.onnx", "manifest.json", "tokenizer/tokenizer.json"} <= set(rows)
