"""HF parity for every family and variant kiln exports, from bf16 sharded checkpoints that
transformers itself wrote: fp32 logits over a prefill and greedy decode steps, within the golden
tolerance, for each sequence alone (SequenceRunner) and for all of them in one batch."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kiln.contract.artifact import EngineArtifact
from kiln.contract.engine import PagedBatch
from kiln.engines.load import load_engine
from kiln.compiler.eval.sequence import SequenceRunner
from kiln.compiler.export.families import spec_from_hf_config
from model_checkpoints import VARIANTS

TOL = 1e-3
DECODE_STEPS = 6
PROMPT_LENS = (5, 28, 40)    # 40 > the longrope/yarn variants' original context (32 / 64 ...)


def _prompts(vocab: int = 256) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(3, vocab, n).tolist() for n in PROMPT_LENS]


def hf_reference(model, prompt: list[int], steps: int = DECODE_STEPS) -> tuple[list[np.ndarray], list[int]]:
    """Logits of the prefill (every position) and of each greedy step, through HF's own KV cache."""
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        logits, tokens = [out.logits[0].numpy()], []
        for _ in range(steps):
            tokens.append(int(logits[-1][-1].argmax()))
            out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)  # noqa: E501
            logits.append(out.logits[0].numpy())
    return logits, tokens


def run_alone(artifact, prompt: list[int], tokens: list[int]) -> list[np.ndarray]:
    runner = SequenceRunner(EngineArtifact.load(artifact), len(prompt) + len(tokens))
    return [runner.feed(prompt)] + [runner.feed([t]) for t in tokens]


class BatchDriver:
    """All sequences in one engine call per step: a batched prefill, then batched decodes."""

    def __init__(self, artifact, max_lens: list[int]):
        self.engine = load_engine(EngineArtifact.load(artifact))
        self.bs = self.engine.kv_layout.block_size
        counts = [-(-n // self.bs) for n in max_lens]
        self.engine.allocate_kv(sum(counts))
        ids = np.random.default_rng(1).permutation(sum(counts)).astype(np.int64)
        self.tables = np.split(ids, np.cumsum(counts)[:-1])
        self.lens = [0] * len(max_lens)

    def step(self, chunks: list[list[int]]) -> list[np.ndarray]:
        spans = [np.arange(p, p + len(c), dtype=np.int64) for p, c in zip(self.lens, chunks)]
        positions = np.concatenate(spans)
        slots = np.concatenate([t[s // self.bs] * self.bs + s % self.bs for t, s in zip(self.tables, spans)])
        batch = PagedBatch(
            input_ids=np.asarray(sum(chunks, []), np.int64), positions=positions,
            query_lens=np.asarray([len(c) for c in chunks], np.int64), past_lens=np.asarray(self.lens, np.int64),
            block_tables=[t[: -(-(p + len(c)) // self.bs)] for t, p, c in zip(self.tables, self.lens, chunks)],
            slot_mapping=slots,
            logits_indices=np.arange(len(positions), dtype=np.int64))
        logits = self.engine.execute(batch).logits
        self.lens = [p + len(c) for p, c in zip(self.lens, chunks)]
        return np.split(logits, np.cumsum([len(c) for c in chunks])[:-1])


def run_batched(artifact, prompts: list[list[int]], tokens: list[list[int]]) -> list[list[np.ndarray]]:
    driver = BatchDriver(artifact, [len(p) + len(t) for p, t in zip(prompts, tokens)])
    outs = [[x] for x in driver.step(prompts)]
    for step in range(len(tokens[0])):
        for seq, x in zip(outs, driver.step([[t[step]] for t in tokens])):
            seq.append(x)
    return outs


def worst_difference(mine: list[np.ndarray], ref: list[np.ndarray]) -> float:
    assert [a.shape for a in mine] == [b.shape for b in ref]
    return max(float(np.abs(a - b).max()) for a, b in zip(mine, ref))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variant_matches_transformers_alone_and_batched(variant, variant_checkpoint, variant_artifact, variant_hf):
    artifact, model = variant_artifact(variant), variant_hf(variant)
    saved = json.loads((variant_checkpoint(variant) / "config.json").read_text())
    assert EngineArtifact.load(artifact).manifest.spec == spec_from_hf_config(saved)    # the manifest round-trips
    refs = [hf_reference(model, p) for p in _prompts()]
    alone = max(worst_difference(run_alone(artifact, p, toks), ref) for p, (ref, toks) in zip(_prompts(), refs))
    batched = run_batched(artifact, _prompts(), [toks for _, toks in refs])
    together = max(worst_difference(mine, ref) for mine, (ref, _) in zip(batched, refs))
    assert alone <= TOL and together <= TOL, f"{variant}: alone {alone:.2e}, batched {together:.2e} > {TOL}"


def test_sliding_window_hides_keys_older_than_the_window(variant_artifact, variant_hf):
    """Past the window (8) the logits differ from full attention, so the parity above tests the window."""
    artifact, model = variant_artifact("mistral-window"), variant_hf("mistral-window")
    assert EngineArtifact.load(artifact).manifest.spec.sliding_window == 8
    check_window_hides_old_keys(artifact, model)


def check_window_hides_old_keys(artifact, model, window: int = 8) -> None:
    """The artifact matches HF with its window, and full attention differs past the window only."""
    prompt = _prompts()[2]
    ref, tokens = hf_reference(model, prompt)
    model.config.sliding_window = None
    try:
        full, _ = hf_reference(model, prompt)
    finally:
        model.config.sliding_window = window
    mine = run_alone(artifact, prompt, tokens)
    assert worst_difference(mine, ref) <= TOL
    assert float(np.abs(mine[0][window:] - full[0][window:]).max()) > 100 * TOL   # keys out of the window matter
    assert float(np.abs(mine[0][:window] - full[0][:window]).max()) <= TOL         # and inside it nothing changes


@pytest.mark.parametrize("variant", ["mistral-window", "gemma2", "gemma3"])
def test_chunked_prefill_past_the_window_matches_one_prefill(variant, variant_artifact, variant_hf):
    """Chunks of 7 over a 40-token prompt: the window then spans keys read from the paged pool."""
    check_chunked_prefill_matches_one(variant_artifact(variant), variant_hf(variant))


def check_chunked_prefill_matches_one(artifact, model, chunk: int = 7) -> None:
    prompt = _prompts()[2]
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0].numpy()
    runner = SequenceRunner(EngineArtifact.load(artifact), len(prompt))
    assert worst_difference([runner.feed_chunked(prompt, chunk)], [ref]) <= TOL


def test_gemma_legacy_gelu_config_reads_as_the_tanh_gemma_runs():
    """Gemma's own config.json says hidden_act "gelu"; GemmaConfig runs it as gelu_pytorch_tanh, so does kiln."""
    from model_checkpoints import make_config

    cfg = json.loads(make_config("gemma").to_json_string()) | {"hidden_act": "gelu"}
    assert spec_from_hf_config(cfg).activation == "gelu_tanh"
