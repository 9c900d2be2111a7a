"""`kiln build --backend ort-cuda`: kiln's graph with PagedAttention, for ONNX Runtime's CUDA provider.

    fused / quantized standard graph ─ paged_graph (PagedAttention per layer) ─ model.onnx(.data)
    [CPU: the graph resolves in ONNX Runtime (checks.py)]
    [GPU, when this machine has one: the engine vs ONNX Runtime CPU on kiln's paged-gather graph,
     with Polygraphy over the same paged steps]
    engine record: files, io, KV cache dtype and layout, onnxruntime version, device, the checks

Everything but the GPU comparison runs on a CPU, so an artifact can be built anywhere; the record
says whether the comparison ran.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import onnx
import onnxruntime as ort

from kiln.contract.artifact import file_record
from kiln.contract.engine import KvLayout
from kiln.compiler.backends.built import BuiltEngines
from kiln.compiler.backends.gpu.compare import as_pass_report
from kiln.compiler.backends.gpu.onnx_files import save_onnx, with_weights_inline
from kiln.compiler.backends.ort_cuda.checks import check_resolves
from kiln.compiler.backends.ort_cuda.paged_graph import paged_attention_graph
from kiln.contract.model_spec import ModelSpec
from kiln.compiler.passes.base import PassCheckError

BACKEND = "ort-cuda"
# --precision -> the dtype PagedAttention computes in and keeps its cache in (it has no fp32 kernel).
CACHE_DTYPES = {"": "float16", "fp16": "float16", "bf16": "bfloat16"}
TOLERANCES = {"logits": (5e-2, 5e-2)}          # fp16 attention against fp32 ONNX Runtime CPU


def build_ort_cuda(model: onnx.ModelProto, spec: ModelSpec, config, root: Path,
                   stage) -> tuple[list[dict], KvLayout, list[dict]]:
    """kiln.compiler.build's ort-cuda step: (engine records, KV layout, pass reports)."""
    if config.precision not in CACHE_DTYPES:
        raise ValueError(f"the ort-cuda backend computes attention in fp16 or bf16 (PagedAttention has no "
                         f"{config.precision} kernel); pass --precision fp16 or bf16")
    cache_dtype = CACHE_DTYPES[config.precision]
    out = root / "engines" / BACKEND
    with stage("rewrite attention to PagedAttention"):
        paged = paged_attention_graph(with_weights_inline(model), spec, cache_dtype)
        io = {v.name: [d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim]
              for v in [*paged.graph.input, *paged.graph.output]}
        path, weights = save_onnx(paged, out)
        del paged
    with stage("check the graph resolves in ONNX Runtime"):
        checks = [check_resolves(path)]
    # NOTE: block_bytes given: numpy has no bfloat16 for KvLayout to size the block by (2 bytes either way).
    block_bytes = spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * 2 * config.block_size
    layout = KvLayout(spec.num_layers, spec.num_kv_heads, spec.head_dim, config.block_size, cache_dtype, block_bytes)
    record = {"backend": BACKEND, **file_record(root, path), "io": io, "onnxruntime": ort.__version__,
              "kv_cache": {"dtype": cache_dtype, "shape": ["num_blocks", "block_size", "kv_heads", "head_dim"]},
              "checks": checks}
    if weights is not None:
        record["weights"] = file_record(root, weights)
    with stage("compare with ONNX Runtime CPU (Polygraphy)"):
        t0 = time.perf_counter()
        record["compare"] = compare_on_gpu(model, spec, config, path, layout) if config.verify else {"skipped": "--no-verify"}
    reports = [] if "skipped" in record["compare"] else [
        as_pass_report(record["compare"], len(model.graph.node), time.perf_counter() - t0)]
    return [record], layout, reports


def compare_on_gpu(model: onnx.ModelProto, spec: ModelSpec, config, path: Path, layout: KvLayout) -> dict:
    """The CUDA engine against ONNX Runtime CPU on kiln's paged-gather graph of the same model."""
    from kiln.engines.gpu.device import cuda_device_count

    if cuda_device_count() == 0 or "CUDAExecutionProvider" not in ort.get_available_providers():
        return {"skipped": "no CUDA GPU and onnxruntime-gpu on the build machine; nothing ran on a GPU"}
    from kiln.compiler.backends.gpu.compare import compare_engines, engine_runner, probe_steps
    from kiln.engines.ort_cuda.engine import OrtCudaEngine, cuda_session
    from kiln.engines.ort.engine import OrtEngine
    from kiln.compiler.passes.kv_io import KvIoPass

    with tempfile.TemporaryDirectory(prefix="kiln-ort-cuda-ref-") as tmp:
        ref_path, _ = save_onnx(with_weights_inline(KvIoPass(spec, config.block_size).run(model)), Path(tmp))
        cpu_layout = KvLayout(spec.num_layers, spec.num_kv_heads, spec.head_dim, config.block_size)
        ref = engine_runner("ort-cpu", lambda: OrtEngine(ref_path, config.buckets, cpu_layout))
        cand = engine_runner("ort-cuda", lambda: OrtCudaEngine(cuda_session(path), config.buckets, layout))
        report = compare_engines(ref, cand, probe_steps(spec.vocab_size, config.block_size), TOLERANCES)
    if not report["passed"]:
        raise PassCheckError(f"the ort-cuda engine disagrees with ONNX Runtime CPU: {report['outputs']}")
    return report


def build_engines(model: onnx.ModelProto, spec: ModelSpec, config, root: Path, stage) -> BuiltEngines:
    return BuiltEngines(*build_ort_cuda(model, spec, config, root, stage))
