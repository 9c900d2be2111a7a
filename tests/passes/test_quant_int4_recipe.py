"""The integer-zero-point int4 recipes in the quantize pass on the tiny presets: MatMulNBits alone
(no side path), what the report says, the calibration it ran, and a mixed split."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from kiln.compiler.export.decoder_graph import build_decoder
from kiln.compiler.passes.base import run_pass
from kiln.compiler.passes.int4_calibration import calibration_token_ids, linear_inputs
from kiln.contract.quant import QuantMode
from kiln.compiler.passes.quantize import MIN_TOP1, QuantizePass
from kiln.compiler.passes.quant_settings import QuantSettings
from kiln.compiler.passes.verify_quant import QuantCheck, check_token_ids

SIDE_PATH = ("/block_sums", "/block_offset", "/add_block_offset")      # block_offsets.py's nodes


@pytest.fixture(scope="module")
def calibration(tiny_sources):
    return {name: calibration_token_ids(src.tokenizer_dir, 256) for name, src in tiny_sources.items()}


def side_path_nodes(model: onnx.ModelProto) -> list[str]:
    return [n.name for n in model.graph.node if n.name.endswith(SIDE_PATH)]


def int4_linears(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == "MatMulNBits"
            and next(a.i for a in n.attribute if a.name == "bits") == 4]


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_the_int4_recipe_is_matmul_nbits_alone(tiny_sources, calibration, name):
    """The default INT4 recipe: attention 4-bit with searched integer zero points, the MLP and the
    tables 8-bit; no block-offset side path anywhere."""
    model = build_decoder(tiny_sources[name].spec, tiny_sources[name].weights)
    p = QuantizePass(QuantSettings(QuantMode.INT4), calibration_ids=calibration[name])
    check = QuantCheck("quantize", check_token_ids(tiny_sources[name].tokenizer_dir, 512), MIN_TOP1[QuantMode.INT4])
    out, report = run_pass(p, model, check)
    assert side_path_nodes(out) == []
    # one MatMulNBits per MatMul; a tied 8-bit embedding adds its Reshape (quant_tables._gather_in_place)
    assert len(out.graph.node) - len(model.graph.node) in (0, 1)
    inits = {t.name: t for t in out.graph.initializer}
    linears = int4_linears(out)
    assert {n.name.split("/")[-2] for n in linears} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert len(linears) == 8 and d_bits(report) == {4: 8, 8: 7}   # 2 layers; gate, up, down and the head 8-bit
    for n in linears:
        zp = numpy_helper.to_array(inits[n.input[3]])
        k, blocks = (next(a.i for a in n.attribute if a.name == key) for key in ("K", "block_size"))
        assert zp.dtype == np.uint8 and zp.shape[1] == -(-k // blocks // 2)   # packed 4-bit: the fast kernel
    d = report.details
    assert d["int4_rounding"] == "search" and d["block_offsets"] is False
    assert d["calibration_tokens"] == len(calibration[name])
    assert d["top1_agreement"] >= MIN_TOP1[QuantMode.INT4]


def d_bits(report) -> dict:
    return report.details["matmuls_by_bits"]


def test_a_mixed_split_keeps_block_offsets_only_where_named(tiny):
    _, model = tiny
    out = QuantizePass(QuantSettings(QuantMode.INT4, int8_linears=(), offset_linears=("layers.1",))).run(model)
    sides = side_path_nodes(out)
    assert sides and all("/layers.1/" in s for s in sides)
    per_linear = Counter(s.rsplit("/", 1)[0] for s in sides)
    assert set(per_linear.values()) == {3} and len(per_linear) == 7     # the 7 linears of layer 1, 3 nodes each


def test_an_unknown_rounding_is_refused():
    with pytest.raises(ValueError, match="int4_rounding must be one of"):
        QuantSettings(QuantMode.INT4, int4_rounding="gptq")


def test_calibration_probes_every_linear_input(tiny):
    _, model = tiny
    names = linear_inputs(model)
    consumers = {n.input[0] for n in model.graph.node if n.op_type == "MatMul"}
    assert names and set(names) <= consumers and len(names) == len(set(names))

