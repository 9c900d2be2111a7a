"""HF parity of every family and variant on the openvino backend (OpenVINO's paged attention), as
test_family_parity.py does for the default (ort) build: fp32 logits over a prefill and greedy
decode steps within the same golden tolerance, each sequence alone and all in one packed call.

A broken window or query scale is far outside that tolerance: past the window (8) the logits of
full attention differ from the windowed ones by > 100x TOL (test_sliding_window_hides_keys_older_than
_the_window), and Gemma's query scale (query_pre_attn_scalar 24 against head_dim 16) scales every
score by 0.82. Gemma 2 (attention-score soft-capping, which the operation cannot compute) keeps
kiln's paged gather in the graph; its cap (5.0) moves the logits far beyond TOL too
(test_gemma2_scores_are_capped).
"""

from __future__ import annotations

import json

import numpy as np

import pytest

pytest.importorskip("openvino")

from kiln.compiler.build import build  # noqa: E402
from kiln.compiler.defaults import openvino_blocker  # noqa: E402
from kiln.compiler.plan import BuildHost  # noqa: E402
from kiln.compiler.export.families import spec_from_hf_config  # noqa: E402
from kiln.config import BuildConfig  # noqa: E402
from kiln.contract.artifact import EngineArtifact  # noqa: E402
from kiln.contract.quant import QuantMode  # noqa: E402
from model_checkpoints import VARIANTS  # noqa: E402
from test_family_parity import (TOL, _prompts, check_chunked_prefill_matches_one,  # noqa: E402
                                check_window_hides_old_keys, hf_reference, run_alone, run_batched,
                                worst_difference)

GATHERED = {"gemma2"}          # attention-score soft-capping: kiln's paged gather, not OpenVINO's operation
COVERED = sorted(VARIANTS)


@pytest.fixture(scope="session")
def openvino_artifact(tmp_path_factory, variant_checkpoint):
    made = {}

    def get(variant: str):
        if variant not in made:
            out = tmp_path_factory.mktemp("openvino-artifacts") / variant
            made[variant] = build(BuildConfig(source=str(variant_checkpoint(variant)), out=out, backend="openvino",
                                              quant=QuantMode.NONE))
        return made[variant]
    return get


@pytest.mark.parametrize("variant", COVERED)
def test_variant_matches_transformers_alone_and_batched(variant, variant_checkpoint, openvino_artifact, variant_hf):
    artifact, model = openvino_artifact(variant), variant_hf(variant)
    manifest = EngineArtifact.load(artifact).manifest
    record = manifest.engines[0]
    assert record["backend"] == "openvino" and "compiled" in record
    assert record["layout"] == ("paged-gather" if variant in GATHERED else "openvino-paged")
    saved = json.loads((variant_checkpoint(variant) / "config.json").read_text())
    assert manifest.spec == spec_from_hf_config(saved)
    assert "does not cover" not in openvino_blocker(QuantMode.INT8, manifest.spec, BuildHost.probe())   # --backend auto takes it
    refs = [hf_reference(model, p) for p in _prompts()]
    alone = max(worst_difference(run_alone(artifact, p, toks), ref) for p, (ref, toks) in zip(_prompts(), refs))
    batched = run_batched(artifact, _prompts(), [toks for _, toks in refs])
    together = max(worst_difference(mine, ref) for mine, (ref, _) in zip(batched, refs))
    assert alone <= TOL and together <= TOL, f"{variant}: alone {alone:.2e}, batched {together:.2e} > {TOL}"


def test_sliding_window_hides_keys_older_than_the_window(openvino_artifact, variant_hf):
    """Past the window (8) the logits differ from full attention, so the parity above tests the window."""
    check_window_hides_old_keys(openvino_artifact("mistral-window"), variant_hf("mistral-window"))


@pytest.mark.parametrize("variant", ["mistral-window", "qwen2-window-some-layers", "gemma3", "gemma2"])
def test_chunked_prefill_past_the_window_matches_one_prefill(variant, openvino_artifact, variant_hf):
    """Chunks of 7 over a 40-token prompt: the window then spans keys read from the paged blocks."""
    check_chunked_prefill_matches_one(openvino_artifact(variant), variant_hf(variant))


def test_gemma2_scores_are_capped(openvino_artifact, variant_hf):
    """The parity above tests the cap: transformers without it differs far beyond TOL."""
    model, prompt = variant_hf("gemma2"), _prompts()[2]
    ref, tokens = hf_reference(model, prompt)
    layers = [layer.self_attn for layer in model.model.layers]
    for attn in layers:
        attn.attn_logit_softcapping = None
    try:
        uncapped, _ = hf_reference(model, prompt)
    finally:
        for attn in layers:
            attn.attn_logit_softcapping = model.config.attn_logit_softcapping
    mine = run_alone(openvino_artifact("gemma2"), prompt, tokens)
    assert worst_difference(mine, ref) <= TOL
    assert float(np.abs(mine[0] - uncapped[0]).max()) > 100 * TOL
