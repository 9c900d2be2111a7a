"""Which OpenVINO options a build takes for each quant mode (the loader reads them back from the record)."""

from __future__ import annotations

from kiln.compiler.backends.openvino.weights import WeightCompression
from kiln.contract.quant import QuantMode
from kiln.engines.openvino import native
from kiln.engines.openvino.options import OpenVinoOptions, cpu_computes_bf16


# A u8 cache's keys per channel over each block: what the plugin does unasked in this release, pinned
# so that the record says it. Per token, 32 decodes ran in 0.93-0.99x the time, for perplexity through
# the engine +2.2 % over fp32 instead of +1.5 % (docs/benchmarks.md, "The 32-stream margin").
U8_KEYS = "by_channel"


# int8 on kiln's own linears (kiln/engines/openvino/native: AVX-512 VNNI, no AMX, the library built):
# activations smoothed (SmoothQuant, calibrated at build) and quantized per row inside the operation,
# so the rest of the graph computes f32 (bf16 would put two reorders around each of kiln's nodes).
# Against the bf16 recipe on an AMD EPYC: 32 decodes 0.88-0.93x the call time, one decode 0.92-0.99x,
# a 512-token prefill 0.91-0.95x; perplexity on a held-out text 22.39 against 22.74 (fp32 22.20)
# (docs/benchmarks.md, "kiln's int8 linears become the default").
KILN_INT8 = OpenVinoOptions(inference_precision="f32", kv_cache_precision="u8", key_cache_quant_mode=U8_KEYS,
                            weights=WeightCompression.INT8.value, dynamic_quantization_group_size=128,
                            kernels=native.KERNELS)


def options_for_quant(quant: QuantMode, native_bf16: bool | None = None,
                      kiln_kernels: bool | None = None) -> OpenVinoOptions:
    """fp32 keeps f32 compute and an f32 cache, so HF parity tolerances hold. int8 takes NNCF's
    per-channel symmetric weights and activations in groups of 128 (on MatMulNBits' blocks of 32,
    larger groups fall off the fast path). Its compute follows the build CPU (native_bf16; asked of
    the plugin when None): where it computes bf16 natively, bf16 with a u8 cache (the plugin's own
    default there; a 512-token prefill at 0.77-0.90x the CPU time of f32 compute, 32 decodes at
    1.00-1.11x, perplexity +1.7 % over fp32 against +1.3 %), elsewhere f32 with an f16 cache (f32
    compute reads it; the u8 cache's per-token dequantization costs f32 compute more than its bytes
    save: 32 decodes at 1.06-1.15x). A bf16 cache is what the plugin makes of an f16 one under bf16
    compute; u8 holds twice the tokens in the same memory. int4 takes the layers' linears
    as Q4_1 blocks (exact on a Q4_1 source) in the augmented form (weights.py), bf16 compute (TTFT
    and batched decodes ahead of f32 for +0.8 points of check perplexity), a u8 cache and activations
    in groups of 32 (the weights' group); the engine then runs ~0.8x the CPU time per decode of
    OpenVINO reading kiln's block-offset MatMulNBits.
    The measurements behind each choice: docs/benchmarks.md (`python bench/bench_openvino_calls.py`)."""
    if quant is QuantMode.NONE:
        return OpenVinoOptions()
    if quant is QuantMode.INT8:
        if native.usable() if kiln_kernels is None else kiln_kernels:
            return KILN_INT8
        bf16 = cpu_computes_bf16() if native_bf16 is None else native_bf16
        return OpenVinoOptions(inference_precision="bf16" if bf16 else "f32",
                               kv_cache_precision="u8" if bf16 else "f16",
                               weights=WeightCompression.INT8.value, dynamic_quantization_group_size=128,
                               key_cache_quant_mode=U8_KEYS if bf16 else "")
    if quant is QuantMode.INT4:
        return OpenVinoOptions(inference_precision="bf16", kv_cache_precision="u8", key_cache_quant_mode=U8_KEYS,
                               weights=WeightCompression.Q4_1_AUGMENTED.value, dynamic_quantization_group_size=32)
    raise ValueError(f"the openvino backend has no {quant.value} mode; use --quant int8 (OpenVINO "
                     f"quantizes activations itself: dynamic quantization, recorded in the artifact)")
