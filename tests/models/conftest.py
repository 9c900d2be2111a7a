"""Each variant's checkpoint, transformers reference and kiln artifact, made once per session."""

from __future__ import annotations

import pytest

from kiln.compiler.build import build
from kiln.config import BuildConfig
from model_checkpoints import load_hf, write_checkpoint


@pytest.fixture(scope="session")
def variant_checkpoint(tmp_path_factory):
    made = {}

    def get(variant: str):
        if variant not in made:
            made[variant] = write_checkpoint(variant, tmp_path_factory.mktemp(variant))
        return made[variant]
    return get


@pytest.fixture(scope="session")
def variant_artifact(tmp_path_factory, variant_checkpoint):
    made = {}

    def get(variant: str):
        if variant not in made:
            out = tmp_path_factory.mktemp("artifacts") / variant
            made[variant] = build(BuildConfig(source=str(variant_checkpoint(variant)), out=out))
        return made[variant]
    return get


@pytest.fixture(scope="session")
def variant_hf(variant_checkpoint):
    return lambda variant: load_hf(variant_checkpoint(variant))
