"""Rewrite kiln's standard decoder into a packed graph whose attention is com.microsoft PagedAttention.

The op (ONNX Runtime, CUDA only) takes vLLM's interface, which is the runtime's own: packed new
tokens, cumulative sequence lengths, past lengths, a block table and the slot of every new token;
it writes the new K/V into the caches in place (key_cache_out aliases key_cache) and attends over
past + new. Its T is fp16/bf16, so q/k/v are cast at the cut and the output cast back: the rest of
the graph (fp32 or MatMulNBits-quantized) is unchanged.

    input_ids [T], position_ids [T] ─ Unsqueeze(0) ─▶ the old [1, T] token inputs
    per layer:  q (after rope) ─ Reshape [T, H·hd] ─ Cast ──┐
                k (after rope) ─ Reshape [T, kvh·hd] ─ Cast ┤
                v heads        ─ Reshape [T, kvh·hd] ─ Cast ┼─ PagedAttention ─ Cast ─ Unsqueeze(0) ─▶ out_merge's consumers
                key_cache.i, value_cache.i [blocks, block_size, kvh, hd] ┤   └─▶ key_cache_out.i, value_cache_out.i
                cumulative_sequence_length, past_seqlens, block_table, slot_mapping ┘
    /model/final_hidden [1,T,h] ─ Gather(logits_indices, axis 1) ─▶ final norm ─ LM head ─ Squeeze ─▶ logits [N, V]

The dense mask, past inputs and present outputs fall away. Cuts are found by the node names kiln's
exporter keeps stable (the openvino backend cuts at the same places).
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from kiln.compiler.export.decoder_graph import FINAL_HIDDEN
from kiln.contract.model_spec import ModelSpec
from kiln.engines.ort_cuda.engine import cache_name
from kiln.compiler.graph_utils import MS_DOMAIN, ensure_ms_opset, node_named, prune, toposort

CACHE_DTYPES = {"float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}
I32, I64 = TensorProto.INT32, TensorProto.INT64
SEQUENCE_INPUTS = {                                  # name -> (type, shape)
    "cumulative_sequence_length": (I32, ["batch_plus_1"]),
    "past_seqlens": (I32, ["batch"]),
    "block_table": (I32, ["batch", "max_blocks"]),
    "slot_mapping": (I32, ["tokens"]),
}
LOGITS_INDICES = "logits_indices"


def paged_attention_graph(model: onnx.ModelProto, spec: ModelSpec, cache_dtype: str = "float16") -> onnx.ModelProto:
    """The rewritten copy; `model` is kiln's standard graph after fusion and quantization."""
    if spec.sliding_window or any(spec.layer_window(i) for i in range(spec.num_layers)):
        # NOTE: the op has local_window_size, but its edge convention is not yet checked against
        # kiln's (query - key < W); refuse rather than guess.
        raise ValueError("the ort-cuda backend does not support sliding-window attention yet")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    nodes = {n.name: n for n in g.node}
    renames: dict[str, str] = {}
    new_nodes = _packed_tokens(g, renames)
    cache_type = CACHE_DTYPES[cache_dtype]
    for i in range(spec.num_layers):
        new_nodes += _layer(nodes, spec, i, cache_type, renames)
    new_nodes += _logit_rows(g, nodes, renames)
    _rename_inputs(g, renames)
    g.node.extend(new_nodes)
    _replace_io(g, spec, cache_type)
    prune(g)
    toposort(g)
    ensure_ms_opset(out)
    return out


def _packed_tokens(g: onnx.GraphProto, renames: dict[str, str]) -> list[onnx.NodeProto]:
    nodes = []
    for name in ("input_ids", "position_ids"):
        renames[name] = f"/model/packed/{name}_rows"
        nodes.append(helper.make_node("Unsqueeze", [name, _axes0(g)], [renames[name]], name=f"/model/packed/{name}"))
    return nodes


def _layer(nodes: dict, spec: ModelSpec, i: int, cache_type: int, renames: dict[str, str]) -> list[onnx.NodeProto]:
    base = f"/model/layers.{i}/attn/"
    q, k, v = (node_named(nodes, base + n, "ort-cuda").input[0] for n in ("q_groups", "new_key_kv_major", "new_value_kv_major"))
    merged = node_named(nodes, base + "out_merge", "ort-cuda").output[0]
    p = f"{base}paged/"
    hd, heads, kvh = spec.head_dim, spec.num_heads, spec.num_kv_heads
    made = []

    def op(op_type, inputs, name, **attrs):
        made.append(helper.make_node(op_type, inputs, [p + name], name=p + name, **attrs))
        return p + name

    shapes = {"q": [-1, heads * hd], "kv": [-1, kvh * hd]}
    q16 = op("Cast", [op("Reshape", [q, _const(made, p + "q_shape", shapes["q"])], "q_tokens")], "q_cast", to=cache_type)
    kv_shape = _const(made, p + "kv_shape", shapes["kv"])
    k16 = op("Cast", [op("Reshape", [k, kv_shape], "k_tokens")], "k_cast", to=cache_type)
    v16 = op("Cast", [op("Reshape", [v, kv_shape], "v_tokens")], "v_cast", to=cache_type)
    attrs = {"num_heads": heads, "kv_num_heads": kvh, "scale": hd ** -0.5}
    if spec.attn_softcap:
        attrs["softcap"] = float(spec.attn_softcap)
    made.append(helper.make_node(
        "PagedAttention",
        [q16, k16, v16, cache_name("key", i), cache_name("value", i), *list(SEQUENCE_INPUTS)[:3], "", "",
         "slot_mapping"],
        [p + "attn", cache_name("key", i, True), cache_name("value", i, True)],
        name=p + "PagedAttention", domain=MS_DOMAIN, **attrs))
    out32 = op("Cast", [p + "attn"], "out_cast", to=TensorProto.FLOAT)
    renames[merged] = op("Unsqueeze", [out32, _axes0_const(made, p)], "out_rows")
    return made


def _logit_rows(g: onnx.GraphProto, nodes: dict, renames: dict[str, str]) -> list[onnx.NodeProto]:
    """Only the rows in logits_indices reach the final norm and the LM head; logits lose the batch axis."""
    hidden = node_named(nodes, FINAL_HIDDEN, "ort-cuda").output[0]
    picked = "/model/packed/logit_rows"
    renames[hidden] = picked
    logits = next(o for o in g.output if o.name == "logits")
    producer = next(n for n in g.node if "logits" in n.output)
    producer.output[list(producer.output).index("logits")] = "/model/packed/logits_rows"
    return [helper.make_node("Gather", [hidden, LOGITS_INDICES], [picked], name=picked, axis=1),
            helper.make_node("Squeeze", ["/model/packed/logits_rows", _axes0(g)], [logits.name],
                             name="/model/packed/logits")]


def _rename_inputs(g: onnx.GraphProto, renames: dict[str, str]) -> None:
    """Point every consumer of a replaced tensor at its replacement (the new nodes are not added yet)."""
    for n in g.node:
        for j, name in enumerate(n.input):
            if name in renames:
                n.input[j] = renames[name]


def _replace_io(g: onnx.GraphProto, spec: ModelSpec, cache_type: int) -> None:
    vocab = next(o for o in g.output if o.name == "logits").type.tensor_type.shape.dim[-1].dim_value
    del g.input[:]
    g.input.extend([helper.make_tensor_value_info("input_ids", I64, ["tokens"]),
                    helper.make_tensor_value_info("position_ids", I64, ["tokens"])])
    g.input.extend(helper.make_tensor_value_info(n, t, s) for n, (t, s) in SEQUENCE_INPUTS.items())
    g.input.append(helper.make_tensor_value_info(LOGITS_INDICES, I64, ["logits_rows"]))
    cache = ["num_blocks", "block_size", spec.num_kv_heads, spec.head_dim]
    caches = [(kind, i) for i in range(spec.num_layers) for kind in ("key", "value")]
    g.input.extend(helper.make_tensor_value_info(cache_name(k, i), cache_type, cache) for k, i in caches)
    del g.output[:]
    g.output.append(helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["logits_rows", vocab]))
    g.output.extend(helper.make_tensor_value_info(cache_name(k, i, True), cache_type, cache) for k, i in caches)
    del g.value_info[:]


def _axes0(g: onnx.GraphProto) -> str:
    name = "/model/packed/axes0"
    if not any(t.name == name for t in g.initializer):
        g.initializer.append(helper.make_tensor(name, I64, [1], [0]))
    return name


def _axes0_const(made: list, prefix: str) -> str:
    return _const(made, prefix + "axes0", [0])


def _const(made: list, name: str, values: list[int]) -> str:
    made.append(helper.make_node("Constant", [], [name], name=name,
                                 value=helper.make_tensor(name, I64, [len(values)], values)))
    return name
