"""Build side of the tensorrt backend that runs on a CPU: the ONNX graph TensorRT will parse.

kiln's paged-gather graph (passes/kv_io.py, standard ops only) in the precision asked for. TensorRT
11 removed the precision builder flags (networks are strongly typed: each tensor's type is the
graph's), so fp16 is put into the graph here, the KV pool included (logits stay fp32); ONNX
Runtime's CPU run of this very file is then the reference the engine is compared with.

Two islands stay fp32 inside an fp16 graph, with casts at their edges (a strongly typed network
keeps them): the rotary angles, position x inv_freq through cos/sin (fp16 holds integers exactly
only up to 2048, and an angle of a few hundred radians keeps too few fractional bits for its
cosine), and RMSNorm's statistics, x² through the reciprocal root (x² of an activation above 256
is past fp16's largest value).
"""

from __future__ import annotations

import math

import onnx
from onnx import TensorProto, helper

PRECISIONS = ("fp32", "fp16", "bf16")
POSITIONS = "position_ids"
# What lies between the position ids and the cos/sin tables (default, scaled and long rope).
ANGLE_OPS = {"Cast", "Unsqueeze", "Mul", "Div", "Concat", "ReduceMax", "GreaterOrEqual", "Where", "Cos", "Sin"}
TABLE_OPS = {"Cos", "Sin"}                  # the angles' last nodes: the walk stops after them
NORM_STATISTICS = ("ReduceMean", "Add", "Sqrt", "Reciprocal")   # after Pow(x, 2), in this order


def kv_dtype(precision: str) -> str:
    """The KV pool's element type: fp16 graphs read and write their cache in fp16 (half the memory)."""
    return "float16" if precision == "fp16" else "float32"


def is_kv_tensor(name: str) -> bool:
    return name.startswith(("key_cache.", "value_cache.")) or name == "new_kv"


def in_precision(model: onnx.ModelProto, precision: str) -> onnx.ModelProto:
    """fp16: every float tensor inside the graph halved but the fp32 islands; of the graph's inputs
    and outputs only the KV pool and new_kv turn fp16 (logits stay fp32). bf16 stays an fp32 graph:
    TensorRT 10 lowers it with its BF16 builder flag (compile.py)."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose from {', '.join(PRECISIONS)}")
    if precision != "fp16":
        return model
    import onnx_graphsurgeon as gs
    from onnxruntime.transformers.float16 import convert_float_to_float16

    islands = fp32_islands(model.graph)
    marked = _with_island_edges(model, islands)
    # NOTE: the converter appends its edge casts out of order; graphsurgeon re-sorts the nodes.
    edge = [v.name for v in [*model.graph.input, *model.graph.output] if not is_kv_tensor(v.name)]
    half = convert_float_to_float16(marked, keep_io_types=edge, disable_shape_infer=True,
                                    node_block_list=[n.name for n in islands])
    return gs.export_onnx(gs.import_onnx(half).toposort())


def fp32_islands(g: onnx.GraphProto) -> list[onnx.NodeProto]:
    """The nodes an fp16 graph keeps in fp32: the rotary angles and every RMSNorm's statistics.
    Named nodes only: the converter blocks nodes by name (kiln's exporter names every node)."""
    return [n for n in [*_rotary_angles(g), *_norm_statistics(g)] if n.name]


def _consumers(g: onnx.GraphProto) -> dict[str, list[onnx.NodeProto]]:
    out: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        for i in n.input:
            out.setdefault(i, []).append(n)
    return out


def _rotary_angles(g: onnx.GraphProto) -> list[onnx.NodeProto]:
    """Every angle op reachable from the position ids, up to and including Cos and Sin."""
    consumers, seen, found, stack = _consumers(g), set(), [], [POSITIONS]
    while stack:
        for n in consumers.get(stack.pop(), []):
            if n.name in seen or n.op_type not in ANGLE_OPS:
                continue
            seen.add(n.name)
            found.append(n)
            if n.op_type not in TABLE_OPS:
                stack.extend(n.output)
    return found


def _norm_statistics(g: onnx.GraphProto) -> list[onnx.NodeProto]:
    """Each Pow(x, 2) and the chain after it (mean, + eps, sqrt, reciprocal)."""
    consumers, twos, found = _consumers(g), _constants_equal_to(g, 2.0), []
    for pow_node in (n for n in g.node if n.op_type == "Pow" and n.input[1] in twos):
        chain, node = [pow_node], pow_node
        for op_type in NORM_STATISTICS:
            following = consumers.get(node.output[0], [])
            if len(following) != 1 or following[0].op_type != op_type:
                break
            node = following[0]
            chain.append(node)
        found += chain
    return found


def _constants_equal_to(g: onnx.GraphProto, value: float) -> set[str]:
    """Names of the float scalars (initializers and Constant outputs) equal to value."""
    from onnx import numpy_helper

    tensors = {t.name: t for t in g.initializer}
    tensors.update({n.output[0]: a.t for n in g.node if n.op_type == "Constant" for a in n.attribute
                    if a.name == "value"})
    scalars = {name: numpy_helper.to_array(t) for name, t in tensors.items()
               if t.data_type == TensorProto.FLOAT and math.prod(t.dims) == 1}
    return {name for name, a in scalars.items() if float(a.reshape(-1)[0]) == value}


def _with_island_edges(model: onnx.ModelProto, islands: list[onnx.NodeProto]) -> onnx.ModelProto:
    """A copy whose value_info types the islands' float edges (the converter casts exactly the
    tensors it has a type for) and nothing inside them (a typed inner tensor would be cast to fp16
    and back, losing what the island keeps)."""
    inside = {n.name for n in islands}
    produced = {o for n in islands for o in n.output}
    outside = [n for n in model.graph.node if n.name not in inside]
    leaving = produced & ({i for n in outside for i in n.input} | {o.name for o in model.graph.output})
    initializers = {t.name for t in model.graph.initializer}
    entering = {i for n in islands for i in n.input if i and i not in produced and i not in initializers}
    floats = _float_tensors(model, leaving | entering)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    kept = [v for v in out.graph.value_info if v.name not in produced and v.name not in entering]
    del out.graph.value_info[:]
    out.graph.value_info.extend(kept)
    out.graph.value_info.extend(helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in sorted(floats))
    return out


def _float_tensors(model: onnx.ModelProto, names: set[str]) -> set[str]:
    """Which of these tensors are fp32, by ONNX type inference over the graph's structure (the
    weights stand in as typed inputs, so a model of any size infers)."""
    g = model.graph
    weights = [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in g.initializer]
    skeleton = helper.make_model(helper.make_graph(list(g.node), "types", [*g.input, *weights], list(g.output)),
                                 opset_imports=list(model.opset_import), ir_version=model.ir_version)
    inferred = onnx.shape_inference.infer_shapes(skeleton).graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*inferred.input, *inferred.output, *inferred.value_info]}
    return {name for name in names if types.get(name) == TensorProto.FLOAT}
