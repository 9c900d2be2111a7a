"""What an OpenVINO artifact records about how it computes: inference precision and KV-cache precision.

Both are chosen at build time and stored in the engine record, never left to the CPU plugin's
defaults (which differ by CPU: bf16 compute and u8 KV on AVX-512 BF16 parts). The loader compiles
with exactly these properties and refuses when the plugin allocates a different cache.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

from kiln.engines.openvino.weights import WeightCompression

if TYPE_CHECKING:  # kiln.passes imports onnx, a build-time dependency; loading does not need it
    from kiln.passes.quantize import QuantMode

# OpenVINO element type name -> numpy dtype of the cache tensors the plugin allocates.
KV_DTYPES = {"f32": np.float32, "f16": np.float16, "u8": np.uint8}


@dataclass(frozen=True)
class OpenVinoOptions:
    inference_precision: str = "f32"     # INFERENCE_PRECISION_HINT: f32 | bf16 | f16
    kv_cache_precision: str = "f32"      # KV_CACHE_PRECISION: f32 | f16 | u8 (u8 holds per-token scales)
    weights: str = "none"                # a WeightCompression value: none | int8_sym | int8_asym | int4_sym_g32
    # DYNAMIC_QUANTIZATION_GROUP_SIZE: activations quantized to int8 per group of this many values, so
    # compressed weights run int8 x int8 kernels (0: off). The plugin's default differs by weight type
    # (on for 4-bit, off for int8 here), so kiln records its choice. Measured on SmolLM2 under kiln's
    # runtime, 2 threads, one session: int8 off -> 32: 32-way 703 -> 875 tok/s, 1 stream 75.6 -> 81.5,
    # TTFT 512 279 -> 286 ms (128: slower than off); int4 32 -> off: 32-way 773 -> 582, TTFT 315 -> 490.
    dynamic_quantization_group_size: int = 0

    @classmethod
    def for_quant(cls, quant: QuantMode) -> "OpenVinoOptions":
        # fp32 keeps f32 compute and an f32 cache, so HF parity tolerances hold; quantized weights
        # have already given up exactness. int8, measured on SmolLM2 (2 threads, engine calls, one
        # run; bench/bench_openvino_calls.py, perplexity by bench/kv_pool_perplexity.py, fp32 26.32):
        # against the choice before (kiln's MatMulNBits int8 blocks, bf16 compute, u8 KV, activation
        # groups of 32, kiln's rotary fusion), this one takes 0.83x the time for 1 or 8 decodes,
        # 0.80x for 32 (0.62x at 512 tokens of context: the u8 cache's per-token dequantization is
        # the cost), 0.96x for a 512-token prefill; perplexity +1.16% against +0.81%. Parts of it:
        # NNCF per-channel weights alone 1 decode 0.88x, 32 decodes 0.95x; bf16 compute reads the
        # cache only as bf16/u8, f32 compute also as f16/f32; activation groups of 64 / 128 / 192:
        # +1.08% / +1.34% / +1.70% perplexity, 32 decodes 0.85x / 0.81x / 0.79x; per token +4.7%.
        # On MatMulNBits' blocks of 32, groups above 32 fall off the fast path (32 decodes 1.96x).
        if quant.value == "none":
            return cls()
        if quant.value == "int8":
            return cls(inference_precision="f32", kv_cache_precision="f16", weights=WeightCompression.INT8.value,
                       dynamic_quantization_group_size=128)
        if quant.value == "int4":
            # kiln's own 4-bit MatMulNBits (the block-offset recipe: exact on a Q4_1 source), which
            # the plugin reads as it is; activations in groups of 32, the weights' block
            return cls(inference_precision="bf16", kv_cache_precision="u8", weights="none",
                       dynamic_quantization_group_size=32)
        raise ValueError(f"the openvino backend has no {quant.value} mode; use --quant int8 (OpenVINO "
                         f"quantizes activations itself: dynamic quantization, recorded in the artifact)")

    @property
    def compresses_weights(self) -> bool:
        return self.weights != "none"

    def compile_properties(self, threads: int) -> dict[str, str]:
        return {
            "INFERENCE_NUM_THREADS": str(threads),
            "PERFORMANCE_HINT": "LATENCY",
            "NUM_STREAMS": "1",
            "INFERENCE_PRECISION_HINT": self.inference_precision,
            "KV_CACHE_PRECISION": self.kv_cache_precision,
            "DYNAMIC_QUANTIZATION_GROUP_SIZE": str(self.dynamic_quantization_group_size),
        }

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "OpenVinoOptions":
        return cls(**d)
