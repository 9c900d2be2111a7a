"""Build side of the ONNX Runtime backend: ORT's graph optimizations run once, offline."""

from __future__ import annotations

from pathlib import Path

import onnx
import onnxruntime as ort

from kiln.engines.ort_session import cpu_session, session_options
from kiln.export.external import session_config

MODEL_FILE = "model.onnx"
WEIGHTS_FILE = MODEL_FILE + ".data"


def compile_ort(model: onnx.ModelProto, out_dir: Path) -> tuple[Path, Path | None]:
    """Run ORT's graph optimizations once and save the result, so loading does none.

    Returns (model.onnx, model.onnx.data or None): a model whose weights are external data
    (export.external) is saved with its large initializers in model.onnx.data beside it, so an
    engine of any size loads by path. ENABLE_EXTENDED, not ENABLE_ALL: level-3 layout rewrites are
    specific to the build machine's hardware, and the artifact must run on other CPUs.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    target, weights = out_dir / MODEL_FILE, out_dir / WEIGHTS_FILE
    opts = session_options(1, ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED)
    opts.optimized_model_filepath = str(target)
    for key, value in session_config(model, WEIGHTS_FILE).items():
        opts.add_session_config_entry(key, value)
    # NOTE: kiln's cleanup pass already folded constants. ORT's folding would also fold the
    # Reshape that lets a tied embedding share the LM head's quantized table, saving a second
    # copy of the table (33 MB for SmolLM2 int4, 20% of the artifact).
    cpu_session(model.SerializeToString(), opts, disabled_optimizers=["ConstantFolding"])
    return target, weights if weights.is_file() else None
