"""One backend registry serves the build, the loader and the CLI; every entry resolves on both
sides; and an artifact for a backend this kiln lacks is refused with what to do."""

from __future__ import annotations

import click
import pytest

from kiln.contract.artifact import ArtifactError, EngineArtifact
from kiln.cli import build as build_command
from kiln.contract.backends import BACKENDS, get_backend
from kiln.engines.load import load_engine


def test_the_cli_offers_every_registered_backend_and_auto():
    choice = next(p for p in build_command.params if p.name == "backend").type
    assert isinstance(choice, click.Choice)
    assert set(choice.choices) == {"auto", *BACKENDS}


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_every_backend_names_a_builder_and_a_loader_that_exist(name):
    """Resolving imports the module: only paths are checked for the GPU backends' libraries."""
    backend = get_backend(name)
    for path in (backend.builder, backend.loader):
        module, _, function = path.partition(":")
        source = module.replace(".", "/") + ".py"
        assert f"def {function}(" in open(source).read(), f"{path} is not defined"


def test_an_unknown_backend_is_refused_by_the_build():
    with pytest.raises(ValueError, match="unknown engine backend 'tpu-v9'; kiln has ort, openvino"):
        get_backend("tpu-v9")


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
