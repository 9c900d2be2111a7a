"""Weights as ONNX external data: the graph proto holds names and offsets, the bytes live in a file.

Why: protobuf cannot serialize a message over 2 GiB, and a proto that holds the weights is copied
whole by every pass (before/after for the numeric check) and again into each ONNX Runtime session.
With external data a pass copies a few megabytes of graph, and ORT reads the weights from the file.

The build works in one append-only file, `weights.bin`, in a build folder that the model names in
its metadata (WEIGHTS_DIR_KEY), so a pass that adds a weight (a merged projection) appends to it
and every earlier model that points into it stays valid. Offsets are page-aligned so ONNX Runtime
can map them. Small tensors (shapes, axes, norm weights under EXTERNAL_MIN_BYTES) stay inline, so
pattern matchers read them without touching the file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

WEIGHTS_FILE = "weights.bin"
WEIGHTS_DIR_KEY = "kiln.weights_dir"
EXTERNAL_MIN_BYTES = 64 * 1024
ALIGN = 4096
# ONNX Runtime's session option for a model passed as bytes whose weights are external.
ORT_EXTERNAL_FOLDER = "session.model_external_initializers_file_folder_path"


def fill_tensor(t: TensorProto, name: str, array: np.ndarray, weights_dir: Path | None = None) -> TensorProto:
    """Write `array` into `t`: inline, or appended to weights_dir/weights.bin when it is large."""
    t.name, t.data_type = name, helper.np_dtype_to_tensor_dtype(array.dtype)
    t.dims.extend(array.shape)
    data = np.ascontiguousarray(array)
    if weights_dir is None or data.nbytes < EXTERNAL_MIN_BYTES:
        t.raw_data = data.tobytes()
        return t
    offset = _append(Path(weights_dir) / WEIGHTS_FILE, data)
    t.data_location = TensorProto.EXTERNAL
    for key, value in (("location", WEIGHTS_FILE), ("offset", str(offset)), ("length", str(data.nbytes))):
        entry = t.external_data.add()
        entry.key, entry.value = key, value
    return t


def _append(path: Path, data: np.ndarray) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as f:
        end = f.tell()
        offset = -(-end // ALIGN) * ALIGN
        f.write(b"\0" * (offset - end))
        data.tofile(f)
    return offset


def is_external(t: TensorProto) -> bool:
    return t.data_location == TensorProto.EXTERNAL


def tensor_array(t: TensorProto, weights_dir: Path | None) -> np.ndarray:
    """An initializer's values, inline or external (read with a memory map, not loaded whole)."""
    if not is_external(t):
        return numpy_helper.to_array(t)
    info = {e.key: e.value for e in t.external_data}
    dtype = helper.tensor_dtype_to_np_dtype(t.data_type)
    if weights_dir is None:
        raise ValueError(f"initializer {t.name} is external data, but the model names no weights folder")
    count = int(np.prod(t.dims)) if len(t.dims) else 1
    return np.memmap(Path(weights_dir) / info["location"], dtype=dtype, mode="r",
                     offset=int(info.get("offset", 0)), shape=(count,)).reshape(tuple(t.dims))


def stored_bytes(t: TensorProto) -> int:
    """Bytes a tensor occupies as stored (inline or in the weights file), without reading it."""
    if is_external(t):
        info = {e.key: e.value for e in t.external_data}
        if "length" in info:
            return int(info["length"])
        return int(np.prod(t.dims)) * helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    if t.HasField("raw_data"):
        return len(t.raw_data)
    return numpy_helper.to_array(t).nbytes


def attach_weights_dir(model: onnx.ModelProto, weights_dir: Path) -> None:
    prop = next((p for p in model.metadata_props if p.key == WEIGHTS_DIR_KEY), None) or model.metadata_props.add()
    prop.key, prop.value = WEIGHTS_DIR_KEY, str(Path(weights_dir).resolve())


def weights_dir(model: onnx.ModelProto) -> Path | None:
    """The build folder the model's external weights live in; None for a self-contained model."""
    prop = next((p for p in model.metadata_props if p.key == WEIGHTS_DIR_KEY), None)
    return Path(prop.value) if prop is not None else None


def session_config(model: onnx.ModelProto, optimized_data_file: str | None = None) -> dict[str, str]:
    """Session config entries an ORT session over this model's bytes needs (none when self-contained).

    optimized_data_file: when the session also saves an optimized model (an engine compile), its
    large initializers go to this file beside it, so the saved model is over 2 GiB-safe too.
    """
    folder = weights_dir(model)
    if folder is None:
        return {}
    entries = {ORT_EXTERNAL_FOLDER: str(folder)}
    if optimized_data_file:
        entries |= {"session.optimized_model_external_initializers_file_name": optimized_data_file,
                    "session.optimized_model_external_initializers_min_size_in_bytes": str(EXTERNAL_MIN_BYTES)}
    return entries
