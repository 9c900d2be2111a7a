"""The openvino int4 weights: Q4_1 blocks (kiln.compiler.backends.openvino.q4_weights) in the CPU plugin."""

from __future__ import annotations

import json

import numpy as np
import pytest

ov = pytest.importorskip("openvino")
ops = pytest.importorskip("openvino.opset13")

from kiln.compiler.backends.openvino.q4_weights import (  # noqa: E402
    Q4Blocks, augmented_linear, decompression_subgraph)

F16_EPS = 2.0 ** -11        # half an f16 ulp, relative


def _q4_1(n: int, k: int, seed: int = 0) -> Q4Blocks:
    """Q4_1 blocks like llama.cpp's: codes 0..15 with 0 and 15 in every block, d and m f16."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 16, size=(n, k), dtype=np.uint8)
    codes[:, 0::32], codes[:, 1::32] = 0, 15
    d = rng.uniform(0.002, 0.02, size=(n, k // 32)).astype(np.float16)
    m = (-d.astype(np.float32) * rng.uniform(0, 15, size=d.shape)).astype(np.float16)
    return Q4Blocks(codes, d, m)


def _weight_through_plugin(build, k: int) -> np.ndarray:
    """What the CPU plugin multiplies by: the [K, N] product of the identity with the subgraph
    `build(x)`, at f32 compute with activations unquantized."""
    x = ops.parameter([-1, k], ov.Type.f32, name="x")
    compiled = ov.Core().compile_model(ov.Model([build(x)], [x]), "CPU", {
        "INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0", "INFERENCE_NUM_THREADS": "1"})
    return compiled({0: np.eye(k, dtype=np.float32)})[0]


def test_from_weight_recovers_q4_1_blocks_exactly():
    """A Q4_1 tensor dequantized to fp32 (what the build gets from a GGUF) gives its blocks back."""
    blocks = _q4_1(48, 96)
    again = Q4Blocks.from_weight(blocks.dequantize())
    assert np.array_equal(again.codes, blocks.codes)
    assert np.array_equal(again.scales, blocks.scales) and np.array_equal(again.mins, blocks.mins)
    assert np.array_equal(again.dequantize(), blocks.dequantize())


def test_float_zero_point_decompression_equals_q4_1_formula():
    """u4 codes, f16 zero point -m/d and f16 scale d: d·(q - zp) = d·q + m within the zero point's
    f16 rounding, through the plugin's compressed FullyConnected."""
    blocks = _q4_1(40, 64, seed=1)
    got = _weight_through_plugin(
        lambda x: ops.matmul(x, decompression_subgraph(blocks, np.float16, "w"), False, True), 64)
    want = blocks.dequantize().T
    d = np.repeat(blocks.scales.astype(np.float32), 32, axis=1).T
    zp = np.repeat(np.abs(blocks.zero_points()), 32, axis=1).T
    assert np.all(np.abs(got - want) <= d * (zp + 16) * F16_EPS * 2 + 1e-7)


def test_augmented_form_equals_q4_1_formula():
    """i4 codes q - 8 with scale d plus the offsets m + 8d as two 4-bit digits over the block sums:
    within 1/200 of the largest offset of the row (and the f16 rounding of the digits' scales)."""
    blocks = _q4_1(24, 96, seed=2)
    got = _weight_through_plugin(lambda x: augmented_linear(x, blocks, 2, "w"), 96)
    want = blocks.dequantize().T
    offsets = blocks.scales.astype(np.float32) * 8 + blocks.mins.astype(np.float32)
    tolerance = np.abs(offsets).max(axis=1) / 200 + 1e-6
    assert np.all(np.abs(got - want) <= tolerance[None, :])
    one_digit = _weight_through_plugin(lambda x: augmented_linear(x, blocks, 1, "w"), 96)
    assert np.abs(got - want).max() < np.abs(one_digit - want).max()


@pytest.fixture(scope="module")
def ov_tiny_llama_int4(tmp_path_factory):
    """`kiln build tiny-llama --quant int4 --backend openvino`: Q4_1 blocks, checked on the engine."""
    from kiln.compiler.build import build
    from kiln.config import BuildConfig
    from kiln.contract.quant import QuantMode

    out = tmp_path_factory.mktemp("ov-int4") / "tiny-llama"
    return build(BuildConfig(source="tiny-llama", out=out, quant=QuantMode.INT4, backend="openvino"))


def test_int4_build_records_q4_1_weights_and_passes_its_check(ov_tiny_llama_int4):
    manifest = json.loads((ov_tiny_llama_int4 / "manifest.json").read_text())
    names = [p["name"] for p in manifest["passes"]]
    assert "quantize" not in names and "quantize (openvino q4_1_g32_aug)" in names
    quant = manifest["quant"]
    assert quant["mode"] == "int4" and quant["weights"] == "q4_1_g32_aug"
    linears = manifest["model"]["config"]["num_layers"] * 4          # qkv, o, gate_up, down
    assert quant["q4_1"]["form"] == "augmented" and quant["q4_1"]["linears"] == linears
    assert quant["top1_agreement"] >= quant["min_top1_agreement"]
    assert quant["constants_by_type"].get("i4", 0) == linears
    engine = manifest["engines"][0]
    assert engine["options"]["weights"] == "q4_1_g32_aug" and engine["compression"]["weights"] == "q4_1_g32_aug"
