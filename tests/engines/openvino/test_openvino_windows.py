"""What the openvino backend's paged attention computes beyond Llama's, against kiln's dense graph.

The dense standard graph (run by ONNX Runtime over each sequence's whole prefix) is kiln's rule,
itself held to transformers by tests/models: "a key is visible iff query_pos - key_pos < window"
per layer, and scores scaled by query_scale. The engine runs ragged, chunked steps over shuffled
blocks (test_openvino_engine.Sequences), so windows cross block edges and chunk edges.
Each check has its negative control: the same engine with the window one off, or against the graph
without the scale, is off by far more than the tolerance.
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

pytest.importorskip("openvino")

from kiln.compiler.backends.openvino.compile import compile_openvino  # noqa: E402
from kiln.compiler.backends.openvino.coverage import attention_core, uncovered  # noqa: E402
from kiln.contract.engine import BucketGrid, KvLayout  # noqa: E402
from kiln.engines.openvino import paged_graph  # noqa: E402
from kiln.engines.openvino.engine import GATHER_LAYOUT, PAGED_LAYOUT  # noqa: E402
from kiln.engines.openvino.loader import open_openvino  # noqa: E402
from test_openvino_engine import RTOL, DenseReference, Sequences  # noqa: E402

WINDOWED = {
    "window 8": dict(sliding_window=8),                                 # Mistral: every layer, < block (32)
    "window 40": dict(sliding_window=40),                               # wider than a block
    "interleaved": dict(sliding_window=8, layer_types=("sliding_attention", "full_attention")),   # Gemma 2/3
}
LONGROPE = dict(rope_type="longrope", partial_rotary_factor=0.75, rope_scaling=json.dumps({
    "long_factor": [2.0 + 0.5 * i for i in range(6)], "original_max_position_embeddings": 32,
    "short_factor": [1.0 + 0.1 * i for i in range(6)]}, sort_keys=True))
STEPS = ({0: 2, 1: 31, 2: 32, 3: 1, 4: 64}, {0: 1, 1: 1, 2: 5, 3: 31, 4: 1}, {1: 8, 2: 33, 3: 1, 4: 35})
LENGTHS = [3, 40, 70, 33, 100]


def graph(**overrides):
    """tiny-llama's weights under a spec with `overrides`: kiln's fused standard graph."""
    from kiln.compiler.export.decoder_graph import build_decoder
    from kiln.compiler.export.sources import load_source
    from kiln.compiler.passes.base import run_pass
    from kiln.compiler.passes.cleanup import CleanupPass
    from kiln.compiler.passes.fusion import fusion_passes
    from kiln.contract.backends import get_backend

    src = load_source("tiny-llama")
    spec = replace(src.spec, **overrides)
    model = build_decoder(spec, src.weights)
    for p in [CleanupPass(), *fusion_passes(spec, get_backend("openvino").skipped_fusions)]:
        model, _ = run_pass(p, model, None)
    return spec, model


def engine(spec, model, root):
    record = compile_openvino(model, spec, root / "engines" / "openvino", root=root)[0]
    e = open_openvino(root, record, spec, BucketGrid(), KvLayout(**record["kv_layout"]), threads=2)
    assert e.loaded_from == "blob"
    e.allocate_kv(64)
    return e


def worst_error(e, spec, reference, steps=STEPS, lengths=LENGTHS) -> float:
    """Max |engine - dense| over all steps, relative to the logits' max |value|."""
    rng = np.random.default_rng(2)
    seqs = Sequences([rng.integers(0, spec.vocab_size, n).tolist() for n in lengths], e.block_size, e.num_blocks,
                     seed=3)
    worst = 0.0
    for chunk in steps:
        starts = {b: seqs.done[b] for b in chunk}
        got = e.execute(seqs.batch(chunk)).logits
        want = np.concatenate([reference(seqs.tokens[b][:starts[b] + n])[starts[b]:] for b, n in chunk.items()])
        worst = max(worst, float(np.abs(got - want).max() / np.abs(want).max()))
    return worst


@pytest.fixture
def window_offset(monkeypatch):
    """Builds the operation's sliding_window input as (layer window + offset)."""
    original = paged_graph._attention_inputs

    def set_offset(offset: int):
        def shifted(spec, q, k, v, key_cache, value_cache, seq, window):
            return original(spec, q, k, v, key_cache, value_cache, seq, window + offset if window else 0)
        monkeypatch.setattr(paged_graph, "_attention_inputs", shifted)
    return set_offset


@pytest.mark.parametrize("name", sorted(WINDOWED))
def test_sliding_window_is_kilns_rule_exactly(name, window_offset, tmp_path):
    """The operation's sliding_window W keeps key k for query q iff q - k < W: W itself matches the
    dense graph to fp32 rounding, W - 1 and W + 1 do not (prefill, chunks and decodes past the window)."""
    spec, model = graph(**WINDOWED[name])
    assert uncovered(spec) == "" and attention_core(spec)[0] == PAGED_LAYOUT      # OpenVINO's own operation
    reference = DenseReference(spec, model)
    errors = {}
    for offset in (0, -1, 1):
        window_offset(offset)
        errors[offset] = worst_error(engine(spec, model, tmp_path / str(offset)), spec, reference)
    assert errors[0] <= RTOL, errors
    assert min(errors[-1], errors[1]) > 100 * RTOL, errors


def test_windowed_layers_differ_from_full_attention(tmp_path):
    """The windows matter here: the same weights with full attention are far from the windowed graph."""
    spec, model = graph(**WINDOWED["interleaved"])
    full_spec, full_model = graph()
    assert worst_error(engine(full_spec, full_model, tmp_path), spec, DenseReference(spec, model)) > 100 * RTOL


def test_query_pre_attn_scalar_scales_the_scores(tmp_path):
    """Gemma's query_pre_attn_scalar (24, head_dim 16): q is scaled before the cut, the operation
    keeps head_dim**-0.5. The dense graph without that scale is far off: the check sees the scale."""
    spec, model = graph(query_pre_attn_scalar=24.0)
    assert uncovered(spec) == "" and attention_core(spec)[0] == PAGED_LAYOUT
    assert spec.query_scale != spec.head_dim ** -0.5
    e = engine(spec, model, tmp_path)
    assert worst_error(e, spec, DenseReference(spec, model)) <= RTOL
    plain_spec, plain_model = graph()
    assert worst_error(e, spec, DenseReference(plain_spec, plain_model)) > 100 * RTOL     # same steps, rewritten


@pytest.mark.parametrize("fixed", [True, False])
def test_longrope_switch_is_per_packed_sequence(fixed, monkeypatch, tmp_path):
    """Phi-3's longrope takes its long factors once a sequence's call reaches position 32. Packed
    rows hold several sequences: a 5-token prompt next to a 40-token one keeps its short factors
    (without the per-sequence rewrite it would take the long ones and be far off)."""
    if not fixed:
        monkeypatch.setattr(paged_graph, "_last_positions_per_sequence", lambda *a: None)
    spec, model = graph(**LONGROPE)
    e = engine(spec, model, tmp_path)
    # one prefill each (a from-scratch reference re-rotates every key with the call's factors), then decodes
    err = worst_error(e, spec, DenseReference(spec, model), steps=({0: 5, 1: 40}, {0: 1, 1: 1}, {0: 1, 1: 1}),
                      lengths=[7, 42])
    assert (err <= RTOL) if fixed else (err > 100 * RTOL), err


def gathered_engine(spec, model, root, block_size=16):
    """The openvino build of a model the operation cannot compute: kiln's paged gather (kv_io) compiled."""
    from kiln.compiler.passes.base import run_pass
    from kiln.compiler.passes.kv_io import KvIoPass

    paged, _ = run_pass(KvIoPass(spec, block_size, attention="standard"), model, None)
    record = compile_openvino(paged, spec, root / "engines" / "openvino", root=root, gather_block_size=block_size)[0]
    assert record["layout"] == GATHER_LAYOUT
    e = open_openvino(root, record, spec, BucketGrid(), KvLayout(**record["kv_layout"]), threads=2)
    assert e.loaded_from == "blob"
    e.allocate_kv(64)
    return e


def test_attention_softcap_runs_on_kilns_paged_gather(tmp_path):
    """Gemma 2's score soft-cap, which OpenVINO's operation cannot compute, on kiln's paged gather
    (interleaved windows too): the ragged, chunked steps over shuffled blocks match the dense graph;
    the same engine against the graph without the cap is far off."""
    capped = dict(WINDOWED["interleaved"], attn_softcap=1.0)
    spec, model = graph(**capped)
    assert uncovered(spec) == "" and attention_core(spec)[0] == GATHER_LAYOUT
    with pytest.raises(ValueError, match="soft-capping"):
        paged_graph.paged_model(None, spec)
    e = gathered_engine(spec, model, tmp_path)
    assert worst_error(e, spec, DenseReference(spec, model)) <= RTOL
    plain_spec, plain_model = graph(**WINDOWED["interleaved"])
    assert worst_error(e, spec, DenseReference(plain_spec, plain_model)) > 100 * RTOL


def test_gathered_engine_refuses_a_block_outside_the_pool(tmp_path):
    spec, model = graph(attn_softcap=1.0)
    e = gathered_engine(spec, model, tmp_path)
    seqs = Sequences([[1, 2, 3]], e.block_size, e.num_blocks)
    seqs.tables[0][0] = e.num_blocks
    with pytest.raises(ValueError, match="out of range"):
        e.execute(seqs.batch({0: 2}))
