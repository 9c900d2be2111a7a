"""The engine factory and the build's backend registry name the same backends, and an artifact
for a backend this kiln lacks is refused with what to do."""

from __future__ import annotations

import click
import pytest

from kiln.artifact import ArtifactError, EngineArtifact
from kiln.build import ENGINE_BUILDERS
from kiln.cli import build as build_command
from kiln.engines.factory import BACKENDS, load_engine


def test_build_and_load_registries_agree_with_the_cli():
    choice = next(p for p in build_command.params if p.name == "backend").type
    assert isinstance(choice, click.Choice)
    assert set(choice.choices) == set(ENGINE_BUILDERS) == set(BACKENDS)


def test_unknown_backend_is_refused(tmp_path):
    manifest = type("M", (), {"engines": [{"backend": "tpu-v9", "file": "x"}]})()
    artifact = EngineArtifact(tmp_path, manifest)
    with pytest.raises(ArtifactError, match=r"needs the 'tpu-v9' engine backend.*kiln build --backend"):
        load_engine(artifact)
