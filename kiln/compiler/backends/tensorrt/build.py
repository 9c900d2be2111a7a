"""`kiln build --backend tensorrt`: the kv_io graph -> TensorRT engine with a profile per bucket range.

    fused? int8? ─ refused (TensorRT parses standard ONNX ops and fuses on its own)
    kv_io pass (checked against the dense graph) ─ int4: MatMulNBits -> DequantizeLinear (weights.py)
      ─ precision into the graph ─ model.onnx(.data)
    [CPU: that graph vs kiln's on ONNX Runtime, with Polygraphy]
    plan profiles from the bucket grid ─ compile on this GPU ─ model.plan + timing.cache
    [GPU: the engine vs ONNX Runtime CPU on model.onnx, with Polygraphy]
    engine record: files, io, profiles, precision, TensorRT version, device, the comparisons

The GPU is checked first, so a machine without one refuses before any work.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import onnx

from kiln.contract.artifact import file_record
from kiln.contract.engine import KvLayout
from kiln.compiler.backends.built import BuiltEngines
from kiln.compiler.backends.gpu.compare import as_pass_report
from kiln.engines.gpu.profiles import Profile, max_pool_blocks, plan_profiles
from kiln.compiler.backends.gpu.onnx_files import save_onnx, with_weights_inline
from kiln.compiler.backends.tensorrt.graph import in_precision, kv_dtype
from kiln.compiler.backends.tensorrt.weights import int4_weight_only
from kiln.contract.model_spec import ModelSpec
from kiln.compiler.passes.base import PassCheckError

BACKEND = "tensorrt"
PLAN_FILE = "model.plan"
TIMING_CACHE_FILE = "timing.cache"
DEFAULT_PRECISION = "fp16"
# (atol, rtol) on logits against fp32 ONNX Runtime CPU, per precision. SmolLM2-135M's fp16 graph on
# ONNX Runtime CPU measured well inside the fp16 bounds over the probe steps
# (docs/results/2026-12-06-figures-from-code-comments.md); bf16 keeps 3 fewer mantissa bits than fp16.
TOLERANCES = {"fp32": {"logits": (1e-3, 1e-3)}, "fp16": {"logits": (1.5e-1, 5e-2)},
              "bf16": {"logits": (1.0, 1e-1)}}


@dataclass
class PreparedGraph:
    """The CPU half of a tensorrt build: what the GPU half compiles and the record so far."""
    onnx_path: Path
    inputs: dict[str, list]           # graph input -> dims (ints or dim names)
    io: dict[str, list]
    profiles: list[Profile]
    record: dict
    reports: list[dict]


def build_tensorrt(model: onnx.ModelProto, spec: ModelSpec, config, root: Path,
                   stage) -> tuple[list[dict], KvLayout, list[dict]]:
    """kiln.compiler.build's tensorrt step: (engine records, KV layout, pass reports). Refuses early without
    a GPU and TensorRT."""
    from kiln.engines.gpu.device import require_cuda
    from kiln.engines.tensorrt.library import import_tensorrt

    check_graph_for_tensorrt(model, config)
    pool_blocks(spec, config)
    try:
        require_cuda("building a TensorRT engine")
        import_tensorrt()
    except RuntimeError as e:       # NoGpuError, or no TensorRT: a refusal the CLI prints as one line
        raise ValueError(str(e)) from None
    prepared = prepare_graph(model, spec, config, root, stage)
    record = compile_and_check(prepared, spec, config, root, stage)
    return [record], _kv_layout(spec, config), prepared.reports


# kiln's quantized ops the build rewrites into standard ones (weights.py), per --quant.
CONVERTED = {"none": set(), "int4": {"MatMulNBits", "GatherBlockQuantized"}}


def check_graph_for_tensorrt(model: onnx.ModelProto, config) -> None:
    if config.quant.value not in CONVERTED:
        raise ValueError(f"the tensorrt backend takes --quant none or int4 (weight-only, as block-quantized "
                         f"DequantizeLinear); TensorRT has no {config.quant.value} weight-only path")
    custom = sorted({n.op_type for n in model.graph.node if n.domain not in ("", "ai.onnx")
                     or not onnx.defs.has(n.op_type)} - CONVERTED[config.quant.value])
    if custom:
        raise ValueError(f"the tensorrt backend takes standard ONNX ops, and this graph has {', '.join(custom)} "
                         "(ONNX Runtime fusions); build with --no-fuse (TensorRT fuses on its own)")


def pool_blocks(spec: ModelSpec, config) -> int:
    """The KV pool the optimization profiles are planned for: the blocks --kv-cache-memory holds.
    The engine binds the whole pool every call, so this is the shape TensorRT tunes for, and the
    largest pool the engine accepts at run time."""
    if config.kv_cache_memory is None:
        raise ValueError("the tensorrt backend plans its optimization profiles for the KV pool it will serve "
                         "with: pass --kv-cache-memory (the size kiln serve will be given, e.g. 4GiB)")
    layout = _kv_layout(spec, config)
    blocks = config.kv_cache_memory // layout.bytes_per_block
    if blocks < 1:
        raise ValueError(f"--kv-cache-memory {config.kv_cache_memory} bytes holds no KV block "
                         f"({layout.bytes_per_block} bytes each); pass a larger size")
    most = max_pool_blocks(spec.num_kv_heads * config.block_size * spec.head_dim)
    if blocks > most:
        raise ValueError(f"--kv-cache-memory holds {blocks} KV blocks, more than TensorRT indexes in one layer's "
                         f"cache ({most}: int32 element offsets); pass a smaller size")
    return blocks


def precision_of(config) -> str:
    return config.precision or DEFAULT_PRECISION


def prepare_graph(model: onnx.ModelProto, spec: ModelSpec, config, root: Path, stage) -> PreparedGraph:
    """Everything up to the TensorRT compile; runs on a CPU."""
    from kiln.compiler.passes.base import run_pass
    from kiln.compiler.passes.kv_io import KvIoPass
    from kiln.compiler.passes.verify_paged import compare_paged

    kv_io = KvIoPass(spec, config.block_size)
    with stage(f"pass {kv_io.name}"):
        check = (lambda a, b: compare_paged(a, b, spec.num_layers, config.block_size)) if config.verify else None
        paged, report = run_pass(kv_io, model, check)
    precision = precision_of(config)
    out = root / "engines" / BACKEND
    reports = [report.to_dict()]
    weight_quant = {"quant": config.quant.value}
    with stage(f"TensorRT graph ({precision}, weights {config.quant.value})"):
        graph = with_weights_inline(paged)
        if config.quant.value == "int4":
            graph, counts = int4_weight_only(graph)
            weight_quant |= counts
        graph = in_precision(graph, precision)
        inputs, io = _dims(graph.graph.input), _dims([*graph.graph.input, *graph.graph.output])
        onnx_path, weights_file = save_onnx(graph, out)
        del graph
    if config.verify and (precision == "fp16" or config.quant.value != "none"):
        with stage("compare the fp16 graph with fp32 on ONNX Runtime CPU (Polygraphy)"):
            t0 = time.perf_counter()
            compare = compare_graph_precision(paged, onnx_path, spec, config, precision)
            reports.append(as_pass_report(compare, len(paged.graph.node), time.perf_counter() - t0))
    profiles = plan_profiles(config.buckets, config.block_size, spec.max_position_embeddings, pool_blocks(spec, config))
    record = {"backend": BACKEND, "onnx": file_record(root, onnx_path), "io": io, "precision": precision,
              "weight_quant": weight_quant, "profiles": [p.to_dict() for p in profiles]}
    if weights_file is not None:
        record["onnx_weights"] = file_record(root, weights_file)
    return PreparedGraph(onnx_path, inputs, io, profiles, record, reports)


def compare_graph_precision(paged: onnx.ModelProto, onnx_path: Path, spec: ModelSpec, config, precision: str) -> dict:
    """The graph TensorRT will parse, run by ONNX Runtime CPU, against the paged graph it came from
    (MatMulNBits at fp32 activations: the same weights, no activation rounding)."""
    import tempfile

    from kiln.compiler.backends.gpu.compare import compare_engines, engine_runner, probe_steps
    from kiln.engines.ort.engine import OrtEngine
    from kiln.compiler.passes.verify_paged import fp32_activations

    layout, fp32 = _kv_layout(spec, config), _kv_layout(spec, config, "float32")
    with tempfile.TemporaryDirectory(prefix="kiln-trt-ref-") as tmp:
        ref_path, _ = save_onnx(fp32_activations(with_weights_inline(paged)), Path(tmp))
        ref = engine_runner("ort-cpu kiln graph", lambda: OrtEngine(ref_path, config.buckets, fp32, 1))
        cand = engine_runner(f"ort-cpu tensorrt graph ({precision})",
                             lambda: OrtEngine(onnx_path, config.buckets, layout, 1))
        report = compare_engines(ref, cand, probe_steps(spec.vocab_size, config.block_size), TOLERANCES[precision])
    if not report["passed"]:
        raise PassCheckError(f"the {precision} graph for TensorRT disagrees with kiln's graph beyond its "
                             f"tolerance: {report['outputs']}; build with --precision fp32")
    return report


def compile_and_check(prepared: PreparedGraph, spec: ModelSpec, config, root: Path, stage) -> dict:
    """The GPU half: compile, save plan and timing cache, compare with ONNX Runtime CPU, record."""
    from kiln.compiler.backends.gpu.compare import compare_engines, engine_runner, probe_steps
    from kiln.engines.gpu.device import CudaMemory
    from kiln.engines.ort.engine import OrtEngine
    from kiln.compiler.backends.tensorrt.compile import compile_engine
    from kiln.engines.tensorrt.engine import TrtEngine

    out = prepared.onnx_path.parent
    precision = prepared.record["precision"]
    with stage(f"compile TensorRT engine ({len(prepared.profiles)} optimization profiles)"):
        result = compile_engine(prepared.onnx_path, prepared.inputs, prepared.profiles, precision)
    (out / PLAN_FILE).write_bytes(result.plan)
    (out / TIMING_CACHE_FILE).write_bytes(result.timing_cache)
    device = CudaMemory()
    record = {**prepared.record, **file_record(root, out / PLAN_FILE),
              "timing_cache": file_record(root, out / TIMING_CACHE_FILE),
              "tensorrt": result.tensorrt_version, "device": device.info.to_dict()}
    if not config.verify:
        record["compare"] = {"skipped": "--no-verify"}
        return record
    layout = _kv_layout(spec, config)
    with stage("compare the engine with ONNX Runtime CPU (Polygraphy)"):
        ref = engine_runner("ort-cpu", lambda: OrtEngine(prepared.onnx_path, config.buckets, layout))
        cand = engine_runner("tensorrt", lambda: TrtEngine.from_plan(result.plan, record, config.buckets, layout,
                                                           device, spec.vocab_size))
        t0 = time.perf_counter()
        report = compare_engines(ref, cand, probe_steps(spec.vocab_size, config.block_size), TOLERANCES[precision])
    if not report["passed"]:
        raise PassCheckError(f"the TensorRT engine disagrees with ONNX Runtime CPU: {report['outputs']}")
    record["compare"] = report
    prepared.reports.append(as_pass_report(report, 0, time.perf_counter() - t0))
    return record


def _kv_layout(spec: ModelSpec, config, dtype: str = "") -> KvLayout:
    return KvLayout(spec.num_layers, spec.num_kv_heads, spec.head_dim, config.block_size,
                    dtype or kv_dtype(precision_of(config)))


def _dims(values) -> dict[str, list]:
    return {v.name: [d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim] for v in values}


def build_engines(model: onnx.ModelProto, spec: ModelSpec, config, root: Path, stage) -> BuiltEngines:
    return BuiltEngines(*build_tensorrt(model, spec, config, root, stage))
