"""The ONNX file a GPU backend keeps in the artifact: one graph file with its weights beside it."""

from __future__ import annotations

from pathlib import Path

import onnx

from kiln.compiler.export.external import WEIGHTS_DIR_KEY, weights_dir

MODEL_FILE = "model.onnx"
WEIGHTS_FILE = MODEL_FILE + ".data"


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


def save_onnx(model: onnx.ModelProto, out_dir: Path) -> tuple[Path, Path | None]:
    """model.onnx + model.onnx.data: TensorRT's parse_from_file and ONNX Runtime both read this pair.
    NOTE: saving moves the tensors' bytes out of `model` (onnx does it in place)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / MODEL_FILE
    onnx.save(model, target, save_as_external_data=True, all_tensors_to_one_file=True,
              location=WEIGHTS_FILE, size_threshold=1024)
    weights = out_dir / WEIGHTS_FILE
    return target, weights if weights.is_file() else None
