"""Build side of the tensorrt backend that runs on a CPU: the ONNX graph TensorRT will parse.

kiln's paged-gather graph (passes/kv_io.py, standard ops only) in the precision asked for. TensorRT
11 removed the precision builder flags (networks are strongly typed: each tensor's type is the
graph's), so fp16 is put into the graph here, inputs and outputs kept fp32; ONNX Runtime's CPU run
of this very file is then the reference the engine is compared with.
"""

from __future__ import annotations

from pathlib import Path

import onnx

from kiln.export.external import WEIGHTS_DIR_KEY, weights_dir

PRECISIONS = ("fp32", "fp16", "bf16")
MODEL_FILE = "model.onnx"
WEIGHTS_FILE = MODEL_FILE + ".data"


def in_precision(model: onnx.ModelProto, precision: str) -> onnx.ModelProto:
    """fp16: every float tensor inside the graph halved, graph inputs/outputs fp32 (casts at the edge).
    bf16 stays an fp32 graph: TensorRT 10 lowers it with its BF16 builder flag (compile.py)."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose from {', '.join(PRECISIONS)}")
    if precision != "fp16":
        return model
    import onnx_graphsurgeon as gs
    from onnxruntime.transformers.float16 import convert_float_to_float16

    # NOTE: the converter appends its edge casts out of order; graphsurgeon re-sorts the nodes.
    half = convert_float_to_float16(model, keep_io_types=True, disable_shape_infer=True)
    return gs.export_onnx(gs.import_onnx(half).toposort())


def with_weights_inline(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy holding its weights (the build keeps them in an external file, export/external.py)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    folder = weights_dir(model)
    if folder is not None:
        onnx.load_external_data_for_model(copy, str(folder))
        keep = [p for p in copy.metadata_props if p.key != WEIGHTS_DIR_KEY]
        del copy.metadata_props[:]
        copy.metadata_props.extend(keep)
    return copy


def save_for_parser(model: onnx.ModelProto, out_dir: Path) -> tuple[Path, Path | None]:
    """model.onnx + model.onnx.data: TensorRT's parse_from_file and ONNX Runtime both read this pair.
    NOTE: saving moves the tensors' bytes out of `model` (onnx does it in place)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / MODEL_FILE
    onnx.save(model, target, save_as_external_data=True, all_tensors_to_one_file=True,
              location=WEIGHTS_FILE, size_threshold=1024)
    weights = out_dir / WEIGHTS_FILE
    return target, weights if weights.is_file() else None
