"""Golden parity with HF transformers on the same weights: prefill of three prompts and eight
greedy decode steps, fp32 logits within 1e-3 — for the exported graph and for the built artifact."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.contract.artifact import EngineArtifact
from kiln.compiler.eval.sequence import SequenceRunner

TOL = 1e-3
DECODE_STEPS = 8


def _prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(3, vocab, n).tolist() for n in (5, 23, 61)]


def _hf_reference(model, prompt: list[int]) -> tuple[list[np.ndarray], list[int]]:
    """Logits of the prefill (all positions) and of each greedy decode step, with HF's KV cache."""
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        logits, cache = [out.logits[0].numpy()], out.past_key_values
        tokens = []
        for _ in range(DECODE_STEPS):
            tok = int(logits[-1][-1].argmax())
            tokens.append(tok)
            out = model(torch.tensor([[tok]]), past_key_values=cache, use_cache=True)
            logits.append(out.logits[0].numpy())
            cache = out.past_key_values
    return logits, tokens


def _check_artifact(artifact_path, hf_model, vocab):
    art = EngineArtifact.load(artifact_path)
    worst = 0.0
    for prompt in _prompts(vocab):
        ref, tokens = _hf_reference(hf_model, prompt)
        runner = SequenceRunner(art, len(prompt) + DECODE_STEPS)
        mine = [runner.feed(prompt)] + [runner.feed([t]) for t in tokens]
        worst = max(worst, *(float(np.abs(a - b).max()) for a, b in zip(mine, ref)))
    assert worst <= TOL, f"max abs logit difference {worst:.2e} > {TOL}"


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from kiln.compiler.export.presets import write_tiny_checkpoint

    def load(name):
        folder = write_tiny_checkpoint(name, tmp_path_factory.mktemp(name))
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return load


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_tiny_artifact_matches_hf(name, tiny_hf, request):
    artifact = request.getfixturevalue(name.replace("-", "_") + "_artifact")
    _check_artifact(artifact, tiny_hf(name), vocab=259)


@pytest.mark.slow
def test_smollm2_artifact_matches_hf(smollm2_fp32_artifact, smollm2_hf):
    model, _ = smollm2_hf
    _check_artifact(smollm2_fp32_artifact, model, vocab=49152)


@pytest.mark.slow
def test_smollm2_exported_graph_matches_hf(smollm2_source, smollm2_hf):
    """The standard (dense KV) graph straight out of export, before any pass."""
    from kiln.compiler.export.decoder_graph import build_decoder
    from kiln.compiler.passes.verify import logits

    model, _ = smollm2_hf
    graph = build_decoder(smollm2_source.spec, smollm2_source.weights)
    spec = smollm2_source.spec
    for prompt in _prompts(spec.vocab_size):
        n = len(prompt)
        feeds = {"input_ids": np.asarray([prompt]), "position_ids": np.arange(n)[None],
                 "attention_mask": np.ones((1, n), np.int64)}
        for i in range(spec.num_layers):
            for kind in ("key", "value"):
                feeds[f"past_key_values.{i}.{kind}"] = np.zeros((1, spec.num_kv_heads, 0, spec.head_dim), np.float32)
        with torch.no_grad():
            ref = model(torch.tensor([prompt])).logits[0].numpy()
        assert float(np.abs(logits(graph, feeds)[0] - ref).max()) <= TOL
