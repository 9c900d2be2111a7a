"""Build side of the ONNX Runtime backend: ORT's graph optimizations run once, offline."""

from __future__ import annotations

from pathlib import Path

import onnx
import onnxruntime as ort

from kiln.compiler.backends.built import BuiltEngines, StageFn
from kiln.compiler.export.external import session_config
from kiln.compiler.passes.base import run_pass
from kiln.compiler.passes.dynamic_int8 import full_range_weights
from kiln.compiler.passes.kv_io import KvIoPass
from kiln.compiler.passes.verify_paged import compare_paged
from kiln.contract.artifact import file_record
from kiln.contract.engine import KvLayout
from kiln.contract.model_spec import ModelSpec
from kiln.engines.ort import native
from kiln.compiler.defaults import AUTO, choose_attention
from kiln.compiler.plan import BuildHost
from kiln.engines.ort.session import cpu_session, session_options

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
    # copy of the table, a large share of a small model's int4 artifact (the SmolLM2 figure:
    # docs/results/2026-12-06-figures-from-code-comments.md).
    cpu_session(model.SerializeToString(), opts, disabled_optimizers=["ConstantFolding"])
    return target, weights if weights.is_file() else None


def build_engines(model: onnx.ModelProto, spec: ModelSpec, config, root: Path,
               stage: StageFn, folder: str = "ort") -> BuiltEngines:
    """Paged IO in the graph (a gather from the runtime's pool), then ORT's offline optimization."""
    # NOTE: checked at fp32 activations (passes/verify_paged.py)
    # NOTE: "auto" here only when called without the build's plan (which records the choice)
    attention = config.attention
    if attention == AUTO:
        attention = choose_attention(attention, "ort", config.kv_dtype, BuildHost.probe()).value
    kv_io = KvIoPass(spec, config.block_size, attention=attention, kv_dtype=config.kv_dtype)
    with stage(f"pass {kv_io.name}"):
        check = ((lambda a, b: compare_paged(a, b, spec.num_layers, config.block_size, kv_dtype=config.kv_dtype))
                 if config.verify else None)
        model, report = run_pass(kv_io, model, check)
    with stage("compile ONNX Runtime engine"):
        engine, weights = compile_ort(model, root / "engines" / folder)
    record = {"backend": "ort", **file_record(root, engine), "io": io_shapes(model)}
    if weights is not None:
        record["weights"] = file_record(root, weights)
    if native.uses_native_ops(model.graph):     # the loader refuses it where the op library is not built
        record["native_ops"] = native.native_op_names(model.graph)
    if full_range_weights(model.graph):         # the loader refuses it where the CPU has no VNNI
        record["requires_cpu"] = ["vnni"]
    layout = KvLayout(spec.num_layers, spec.num_kv_heads, spec.head_dim, config.block_size, dtype=config.kv_dtype,
                      block_bytes=int8_block_bytes(spec, config.block_size) if config.kv_dtype == "int8" else 0)
    return BuiltEngines([record], layout, [report.to_dict()])


def int8_block_bytes(spec: ModelSpec, block_size: int) -> int:
    """An int8 pool's block: the values and one fp32 scale per token and head (engines/ort/kv_pool.py)."""
    return spec.num_layers * 2 * spec.num_kv_heads * block_size * (spec.head_dim + 4)


def io_shapes(model: onnx.ModelProto) -> dict[str, list]:
    def dims(v):
        return [d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim]
    return {v.name: dims(v) for v in [*model.graph.input, *model.graph.output]}
