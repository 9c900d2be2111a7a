"""What an OpenVINO artifact records about how it computes: inference precision and KV-cache precision.

Both are chosen at build time and stored in the engine record, never left to the CPU plugin's
defaults (which differ by CPU: bf16 compute and u8 KV on AVX-512 BF16 parts). The loader compiles
with exactly these properties and refuses when the plugin allocates a different cache.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
import numpy as np

# OpenVINO element type name -> numpy dtype of the cache tensors the plugin allocates.
KV_DTYPES = {"f32": np.float32, "f16": np.float16, "u8": np.uint8}


def cpu_computes_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX-512 BF16 or AMX), as the CPU plugin reports it."""
    import openvino as ov

    return "BF16" in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")


@dataclass(frozen=True)
class OpenVinoOptions:
    inference_precision: str = "f32"     # INFERENCE_PRECISION_HINT: f32 | bf16 | f16
    kv_cache_precision: str = "f32"      # KV_CACHE_PRECISION: f32 | f16 | u8 (u8 holds per-token scales)
    weights: str = "none"                # a WeightCompression value: none | int8_sym | int4_sym_g32 | q4_1_g32 | q4_1_g32_aug | f16
    # DYNAMIC_QUANTIZATION_GROUP_SIZE: activations quantized to int8 per group of this many values, so
    # compressed weights run int8 x int8 kernels (0: off). The plugin's default differs by weight type
    # (on for 4-bit, off for int8 here), so kiln records its choice (docs/benchmarks.md has the figures).
    dynamic_quantization_group_size: int = 0
    # KEY_CACHE_QUANT_MODE of a u8 cache: "by_channel" (a scale and zero point per channel over each
    # block) or "by_token" (per token and head, as the values have). "" sends nothing: the plugin's
    # default (by_channel in this release), which artifacts built before the field was recorded took.
    key_cache_quant_mode: str = ""
    # "kiln-int8": the layers' linears are kiln's own operations (kiln/engines/openvino/native), so a
    # Core must add kiln's library before it reads or imports the model. "": the plugin's own.
    kernels: str = ""
    # "kiln-u8": attention is kiln's own operation over its own u8 cache (kiln/engines/openvino/
    # kiln_attention.py), which also needs kiln's library. "": the plugin's PagedAttentionExtension.
    attention: str = ""

    @property
    def needs_kiln_library(self) -> bool:
        return bool(self.kernels or self.attention)

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
            **({"KEY_CACHE_QUANT_MODE": self.key_cache_quant_mode.upper()} if self.key_cache_quant_mode else {}),
        }

    def on_this_cpu(self) -> "OpenVinoOptions":
        """These options, with f32 compute where the record asks bf16 of a CPU that has no native
        bf16 (an artifact built on another machine): emulated bf16 would be slower than f32."""
        if self.inference_precision == "bf16" and not cpu_computes_bf16():
            return replace(self, inference_precision="f32")
        return self

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "OpenVinoOptions":
        return cls(**d)
