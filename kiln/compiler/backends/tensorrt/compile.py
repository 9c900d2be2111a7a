"""Build side of the tensorrt backend that needs the GPU: ONNX file -> serialized engine (plan).

    tensorrt.Builder ─ create_network(STRONGLY_TYPED) ─ OnnxParser.parse_from_file(model.onnx)
    BuilderConfig: workspace limit, timing cache (loaded from and saved to the artifact),
                   one IOptimizationProfile per planned profile (set_shape(min, opt, max) per input),
                   BF16 flag for --precision bf16 (TensorRT 10 only; 11 types tensors from the graph)
    build_serialized_network ─▶ model.plan
Imports tensorrt lazily; callers check for a GPU first (gpu/device.py says why).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kiln.engines.gpu.profiles import Profile
from kiln.engines.tensorrt.library import import_tensorrt

WORKSPACE_BYTES = 8 << 30


@dataclass(frozen=True)
class CompileResult:
    plan: bytes
    timing_cache: bytes
    tensorrt_version: str


def compile_engine(onnx_path: Path, inputs: dict[str, list], profiles: list[Profile], precision: str,
                   timing_cache: bytes = b"", workspace_bytes: int = WORKSPACE_BYTES) -> CompileResult:
    trt = import_tensorrt()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(_network_flags(trt, precision))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT's ONNX parser rejected {onnx_path.name}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    _set_precision(trt, config, precision)
    cache = config.create_timing_cache(timing_cache)
    config.set_timing_cache(cache, ignore_mismatch=False)
    for profile in profiles:
        config.add_optimization_profile(_trt_profile(builder, profile, inputs))
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise RuntimeError("TensorRT could not build the engine (see the TensorRT log above)")
    return CompileResult(bytes(plan), bytes(config.get_timing_cache().serialize()), trt.__version__)


def _network_flags(trt, precision: str) -> int:
    # NOTE: TensorRT 10.12+ takes STRONGLY_TYPED (types from the graph); 11 is always strongly typed.
    # bf16 on 10.x is the weakly typed path: its BF16 flag is refused on a strongly typed network.
    flag = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    return 0 if flag is None or precision == "bf16" else 1 << int(flag)


def _set_precision(trt, config, precision: str) -> None:
    tf32 = getattr(trt.BuilderFlag, "TF32", None)
    if precision == "fp32" and tf32 is not None:
        config.clear_flag(tf32)                   # on by default: fp32 matmuls would round to TF32
    if precision != "bf16":
        return                                    # fp32 and fp16 are in the graph (graph.py)
    flag = getattr(trt.BuilderFlag, "BF16", None)
    if flag is None:
        raise RuntimeError(f"TensorRT {trt.__version__} has no BF16 builder flag (11.x types tensors from "
                           "the graph); build with --precision fp16 or fp32")
    config.set_flag(flag)


def _trt_profile(builder, profile: Profile, inputs: dict[str, list]):
    p = builder.create_optimization_profile()
    for name, (lo, opt, hi) in profile.input_shapes(inputs).items():
        p.set_shape(name, lo, opt, hi)
    return p

