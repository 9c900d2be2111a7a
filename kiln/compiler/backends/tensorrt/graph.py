"""Build side of the tensorrt backend that runs on a CPU: the ONNX graph TensorRT will parse.

kiln's paged-gather graph (passes/kv_io.py, standard ops only) in the precision asked for. TensorRT
11 removed the precision builder flags (networks are strongly typed: each tensor's type is the
graph's), so fp16 is put into the graph here, the KV pool included (logits stay fp32); ONNX
Runtime's CPU run of this very file is then the reference the engine is compared with.
"""

from __future__ import annotations

import onnx

PRECISIONS = ("fp32", "fp16", "bf16")


def kv_dtype(precision: str) -> str:
    """The KV pool's element type: fp16 graphs read and write their cache in fp16 (half the memory)."""
    return "float16" if precision == "fp16" else "float32"


def is_kv_tensor(name: str) -> bool:
    return name.startswith(("key_cache.", "value_cache.")) or name == "new_kv"


def in_precision(model: onnx.ModelProto, precision: str) -> onnx.ModelProto:
    """fp16: every float tensor inside the graph halved; of the graph's inputs and outputs only the
    KV pool and new_kv turn fp16 (logits stay fp32). bf16 stays an fp32 graph: TensorRT 10 lowers
    it with its BF16 builder flag (compile.py)."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose from {', '.join(PRECISIONS)}")
    if precision != "fp16":
        return model
    import onnx_graphsurgeon as gs
    from onnxruntime.transformers.float16 import convert_float_to_float16

    # NOTE: the converter appends its edge casts out of order; graphsurgeon re-sorts the nodes.
    edge = [v.name for v in [*model.graph.input, *model.graph.output] if not is_kv_tensor(v.name)]
    half = convert_float_to_float16(model, keep_io_types=edge, disable_shape_infer=True)
    return gs.export_onnx(gs.import_onnx(half).toposort())
