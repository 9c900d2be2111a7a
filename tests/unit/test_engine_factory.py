"""The engine factory and the build's backend registry name the same backends, and an artifact
for a backend this kiln lacks is refused with what to do."""

from __future__ import annotations

import click
import pytest

from kiln.contract.artifact import ArtifactError, EngineArtifact
from kiln.compiler.build import ENGINE_BUILDERS
from kiln.cli import build as build_command
from kiln.engines.load import BACKENDS, load_engine


def test_build_and_load_registries_agree_with_the_cli():
    choice = next(p for p in build_command.params if p.name == "backend").type
    assert isinstance(choice, click.Choice)
    assert set(choice.choices) == set(ENGINE_BUILDERS) == set(BACKENDS)


def test_unknown_backend_is_refused(tmp_path):
    manifest = type("M", (), {"engines": [{"backend": "tpu-v9", "file": "x"}]})()
    artifact = EngineArtifact(tmp_path, manifest)
    with pytest.raises(ArtifactError, match=r"needs the 'tpu-v9' engine backend.*kiln build --backend"):
        load_engine(artifact)


def test_loading_an_ort_engine_needs_no_build_dependencies(tiny_llama_artifact):
    """The runtime install has no onnx: loading and running an artifact must not import it."""
    import subprocess
    import sys

    code = ("import sys; from kiln.runtime.llm import LLM; from kiln.config import RuntimeConfig; "
            f"LLM({str(tiny_llama_artifact)!r}, RuntimeConfig(kv_cache_memory=1 << 22)); "
            "print(sorted(m for m in ('onnx', 'onnx_graphsurgeon', 'kiln.compiler.passes.quantize') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"
