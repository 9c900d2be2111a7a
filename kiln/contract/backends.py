"""The one registry of engine backends: for each, how it builds, how it loads, and what it takes.

The build (kiln.compiler) and the loader (kiln.engines) both read this table, so a backend is named
once. The builder and the loader are dotted paths resolved on first use: an artifact for one
backend never imports another backend's library, and this layer imports neither side.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

# The build options only some backends take (BuildConfig field -> its neutral value).
BACKEND_OPTIONS = {"prefill_engine": "", "attention": "auto", "kv_dtype": "float32"}


@dataclass(frozen=True)
class Backend:
    name: str
    builder: str                     # "module:function" in kiln.compiler that builds its engines
    loader: str                      # "module:function" in kiln.engines that loads one
    device: str                      # "cpu" | "cuda"
    quant_modes: tuple[str, ...]     # QuantMode values it builds
    options: tuple[str, ...] = ()    # keys of BACKEND_OPTIONS it takes
    # QuantMode values whose weights the backend compresses itself from the fp32 graph (kiln's
    # quantize pass then does not run; the check runs on the compiled engine).
    compresses_weights: tuple[str, ...] = ()
    skipped_fusions: tuple["SkippedFusion", ...] = ()    # fusion passes (or parts) it does better without
    # int4 on ORT's CPU kernels takes kiln's searched recipe (MatMulNBits with integer zero points,
    # 8-bit MLP); elsewhere the block-offset recipe, exact on a Q4_1 source.
    cpu_int4_recipe: bool = False
    # QuantMode values it does not build, each with why and what to build instead (said in the refusal)
    without: dict[str, str] = field(default_factory=dict, compare=False)

    def refuses(self, mode: str) -> str:
        """Why this backend does not build `mode`: "" where it does."""
        if mode in self.quant_modes:
            return ""
        why = self.without.get(mode)
        return (f"the {self.name} backend has no {mode} mode" + (f": {why}" if why else "")
                + f"; it builds --quant {' | '.join(self.quant_modes)}")

    def build_function(self) -> Any:
        return _resolve(self.builder)

    def load_function(self) -> Any:
        return _resolve(self.loader)


@dataclass(frozen=True)
class SkippedFusion:
    """A fusion pass, or one part of it, that a backend does better without."""
    fusion: str                      # the pass's name
    part: str = ""                   # one part of the pass ("" the whole pass)
    quant: str = ""                  # only at this QuantMode value ("" at every mode)
    reason: str = ""

    def applies_at(self, quant: str | None) -> bool:
        return not self.quant or self.quant == quant


def _resolve(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


_ORT_CONTRIB = "com.microsoft.SkipSimplifiedLayerNormalization is an ONNX Runtime contrib op"
# OpenVINO's CPU plugin fuses the plain rotary pattern into its RoPE kernel (kiln's fused rotary
# reaches it as a Transpose/Reshape chain), and it splits a merged gate/up output with a reference
# copy of [tokens, 2 x intermediate]: at int8 two FullyConnected nodes run a 512-token prefill a
# little faster, decodes level (bench/bench_openvino_calls.py; docs/results/2026-12-06-figures-from-code-comments.md).
# NOTE: int4 keeps gate/up merged: apart, SmolLM2's Q4_1 build's check perplexity rose and its chat
# answer changed (not investigated).
OPENVINO_SKIPPED_FUSIONS = (
    SkippedFusion("fuse_rotary", reason="OpenVINO's CPU plugin fuses the plain rotary pattern into its RoPE kernel "
                  "(kiln's fused rotary reaches it as a Transpose/Reshape chain)"),
    SkippedFusion("merge_projections", part="mlp", quant="int8",
                  reason="the plugin splits a merged gate/up output with a reference copy: two FullyConnected "
                         "nodes run faster at int8"),
    SkippedFusion("fuse_skip_rms_norm", reason=f"{_ORT_CONTRIB}: OpenVINO's ONNX reader takes the residual Add and the "
                  "norm as they are"),
)
# The ort-cuda build is checked against the CPU graph it rewrites (never run on a GPU here).
GPU_SKIPPED_FUSIONS = (SkippedFusion("fuse_skip_rms_norm", reason=f"{_ORT_CONTRIB}: TensorRT's parser takes the "
                                     "residual Add and the norm as they are"),)

# f16 weights: ONNX Runtime's CPU linears take fp32 weights, so f16 ones need a Cast, which its
# constant folding turns back into fp32 weights, or which (kiln's engines load without optimizations)
# widens every weight on every call. The GPU backends store and compute 16-bit under their own
# --precision (fp16 by default) from fp32 weights.
_ORT_WITHOUT = {"f16": "ONNX Runtime's CPU linears take fp32 weights, so f16 ones would be widened back (a Cast "
                       "folded into fp32 weights, or run on every call); f16 weights build on --backend openvino"}
_GPU_WITHOUT = {"f16": "its --precision fp16 (the default) already stores and computes the weights in fp16: "
                       "build --quant none"}

BACKENDS: dict[str, Backend] = {b.name: b for b in (
    Backend("ort", "kiln.compiler.backends.ort:build_engines", "kiln.engines.ort.loader:load_ort_engine", "cpu",
            quant_modes=("none", "int8", "int4", "w8a8"), options=tuple(BACKEND_OPTIONS), cpu_int4_recipe=True,
            without=_ORT_WITHOUT),
    Backend("openvino", "kiln.compiler.backends.openvino.compile:build_engines",
            "kiln.engines.openvino.loader:load_openvino_engine", "cpu", quant_modes=("none", "int8", "int4", "f16"),
            options=("attention",), compresses_weights=("int8", "int4", "f16"), skipped_fusions=OPENVINO_SKIPPED_FUSIONS),
    Backend("tensorrt", "kiln.compiler.backends.tensorrt.build:build_engines",
            "kiln.engines.tensorrt.loader:load_tensorrt_engine", "cuda", quant_modes=("none", "int4"),
            skipped_fusions=GPU_SKIPPED_FUSIONS, without=_GPU_WITHOUT),
    Backend("ort-cuda", "kiln.compiler.backends.ort_cuda.build:build_engines",
            "kiln.engines.ort_cuda.loader:load_ort_cuda_engine", "cuda", quant_modes=("none", "int8", "int4"),
            skipped_fusions=GPU_SKIPPED_FUSIONS, without=_GPU_WITHOUT),
)}


class UnknownBackend(ValueError):
    pass


def get_backend(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise UnknownBackend(f"unknown engine backend {name!r}; kiln has {', '.join(BACKENDS)}") from None
