"""GGUF files as llama.cpp publishes them, one per architecture string, build and run like their model.

Each tiny file (gguf_writing.py: mixed Q8_0 / Q5_1 / BF16 / Q4_1 / Q4_0 / Q5_0 / F16 tensors, or
K-quants) is built with the Python build API (ort backend, fp32) and its engine's logits over a
prefill and greedy decode steps are checked against the HF model holding exactly the file's values,
and against transformers' own GGUF loader on the same file where transformers reads that
architecture. The spec read from the metadata must equal the one read from the HF config.json.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict

import numpy as np
import pytest
import torch

from gguf_writing import K_MIXED, MODELS, write_gguf
from kiln.compiler.build import build
from kiln.compiler.eval.sequence import SequenceRunner
from kiln.compiler.export.families import spec_from_hf_config
from kiln.config import BuildConfig
from kiln.contract.artifact import EngineArtifact
from kiln.contract.quant import QuantMode

TOL = 1e-3
DECODE_STEPS = 4
# 40 tokens: past Gemma's window (8) and Phi's original context (32)
PROMPT = np.random.default_rng(7).integers(3, 250, 40).tolist()
# transformers' GGUF loader reads these architectures; it ignores llama.cpp's rope tables (rope_freqs,
# rope_factors_*), so the files holding them are checked against their HF model only
TRANSFORMERS_READS = {"llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "llama-kquants"}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    made = {}

    def get(name: str):
        if name not in made:
            quants = K_MIXED if name == "llama-kquants" else None
            kw = {"quants": quants} if quants else {}
            made[name] = write_gguf(name, tmp_path_factory.mktemp(name), **kw)
        return made[name]
    return get


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, written):
    made = {}

    def get(name: str):
        if name not in made:
            out = tmp_path_factory.mktemp("artifacts") / name
            made[name] = build(BuildConfig(source=str(written(name).path), out=out, quant=QuantMode.NONE,
                                           backend="ort"))
        return made[name]
    return get


def reference(model, prompt: list[int], steps: int = DECODE_STEPS) -> tuple[list[np.ndarray], list[int]]:
    """Logits of the prefill and of each greedy step, through the model's own KV cache."""
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        logits, tokens = [out.logits[0].numpy()], []
        for _ in range(steps):
            tokens.append(int(logits[-1][-1].argmax()))
            out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
            logits.append(out.logits[0].numpy())
    return logits, tokens


def engine_logits(artifact, prompt: list[int], tokens: list[int]) -> list[np.ndarray]:
    runner = SequenceRunner(EngineArtifact.load(artifact), len(prompt) + len(tokens))
    return [runner.feed(prompt)] + [runner.feed([t]) for t in tokens]


def worst(mine: list[np.ndarray], ref: list[np.ndarray]) -> float:
    assert [a.shape for a in mine] == [b.shape for b in ref]
    return max(float(np.abs(a - b).max()) for a, b in zip(mine, ref))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_gguf_builds_and_matches_the_model_it_holds(name, written, artifact):
    wr = written(name)
    ref, tokens = reference(wr.model, PROMPT)
    assert worst(engine_logits(artifact(name), PROMPT, tokens), ref) <= TOL


@pytest.mark.parametrize("name", sorted(MODELS))
def test_spec_from_gguf_metadata_is_the_spec_from_config_json(name, written, artifact):
    spec = asdict(EngineArtifact.load(artifact(name)).manifest.spec)
    expected = asdict(spec_from_hf_config(written(name).model.config.to_dict()))
    if name == "llama3-rope":       # llama.cpp keeps llama3 rope as its per-frequency table
        assert spec.pop("rope_type") == "freq_factors" and expected.pop("rope_type") == "llama3"
        spec.pop("rope_scaling"), expected.pop("rope_scaling")
    assert spec == expected


@pytest.mark.parametrize("name", sorted(TRANSFORMERS_READS))
def test_gguf_matches_transformers_gguf_loader(name, written, artifact):
    from transformers import AutoModelForCausalLM

    path = written(name).path
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    ref, tokens = reference(model, PROMPT)
    assert worst(engine_logits(artifact(name), PROMPT, tokens), ref) <= TOL


def test_llama3_rope_comes_from_the_rope_freqs_table(written):
    """Llama 3.x files state their llama3 rope only as rope_freqs (transformers' loader drops it, and
    its logits then differ from the model's by ~0.5 on this file)."""
    from kiln.compiler.export.sources import load_source

    src = load_source(str(written("llama3-rope").path))
    assert src.spec.rope_type == "freq_factors" and json.loads(src.spec.rope_scaling)["freq_factors"][-1] == 8.0


def test_kiln_build_cli_builds_a_gemma3_gguf_as_published(written, tmp_path):
    """The issue's case: `kiln build gemma-3.gguf` refused 'unsupported architecture gemma3'."""
    out = tmp_path / "gemma3-artifact"
    cli = [sys.executable, "-c", "from kiln.cli import main; main()"]
    result = subprocess.run([*cli, "build", str(written("gemma3").path), "--out", str(out), "--backend", "ort",
                             "--quant", "none"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    manifest = EngineArtifact.load(out).manifest
    assert manifest.spec.family == "gemma3" and manifest.spec.layer_types[5] == "full_attention"
