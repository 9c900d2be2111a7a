"""Mark where the paged rewrite cuts kiln's standard graph, by the node names its exporter keeps stable.

The canonical names survive OpenVINO's IR, so the loader's rewrite (kiln.engines.openvino.paged_graph)
finds the q/k/v/out tensors of every layer and the final hidden state without the ONNX graph.
"""

from __future__ import annotations

import onnx
import openvino as ov

from kiln.compiler.export.decoder_graph import FINAL_HIDDEN
from kiln.compiler.graph_utils import node_named
from kiln.contract.model_spec import ModelSpec
from kiln.engines.openvino.paged_graph import (FINAL, ROTARY_SCOPES, cut_name, last_position_name,
                                               outputs_by_tensor_name)


def mark_cuts(ov_model: ov.Model, onnx_model: onnx.ModelProto, spec: ModelSpec) -> None:
    """Add canonical names to the tensors paged_model() cuts at (the ONNX names stay too)."""
    nodes = {n.name: n for n in onnx_model.graph.node}
    marks = {node_named(nodes, FINAL_HIDDEN, "openvino").output[0]: FINAL}
    for i in range(spec.num_layers):
        base = f"/model/layers.{i}/attn/"
        marks.update({node_named(nodes, base + "q_groups", "openvino").input[0]: cut_name(i, "q"),
                      node_named(nodes, base + "new_key_kv_major", "openvino").input[0]: cut_name(i, "k"),
                      node_named(nodes, base + "new_value_kv_major", "openvino").input[0]: cut_name(i, "v"),
                      node_named(nodes, base + "out_merge", "openvino").output[0]: cut_name(i, "out")})
    for scope in ROTARY_SCOPES:                    # longrope's switch (per sequence once packed)
        if f"/model/{scope}/LastPosition" in nodes:
            marks[nodes[f"/model/{scope}/LastPosition"].output[0]] = last_position_name(scope)
    outputs = outputs_by_tensor_name(ov_model)
    for onnx_name, canonical in marks.items():
        outputs[onnx_name].get_tensor().add_names({canonical})
