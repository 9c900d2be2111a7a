"""Which OpenVINO options a build takes for each quant mode (the loader reads them back from the record)."""

from __future__ import annotations

from kiln.compiler.backends.openvino.weights import WeightCompression
from kiln.contract.quant import QuantMode
from kiln.engines.openvino import native
from kiln.engines.openvino.options import OpenVinoOptions
from kiln.compiler.openvino_recipes import computes_bf16, openvino_recipe, uses_kiln_linears
from kiln.compiler.plan import QuantRecipe


# A u8 cache's keys per channel over each block: what the plugin does unasked in this release, pinned
# so that the record says it (docs/results/2026-12-02-default-builds-side-by-side-with-peers.md, "The
# 32-stream margin").
U8_KEYS = "by_channel"
# Under kiln's int8 linears (f32 compute), per token and head, as the values are: decodes read less
# per step and the build's check agrees with fp32 more often, on plain text and in chat
# (docs/results/2026-12-06-serving-third-round.md, "Keys per token").
KILN_INT8_KEYS = "by_token"


# int8 on kiln's own linears (kiln/compiler/openvino_recipes.py says where): against the bf16 recipe on
# an AMD EPYC, 32 decodes, one decode and a 512-token prefill all took less call time, and perplexity
# on a held-out text came closer to fp32's (docs/results/2026-12-02-default-builds-side-by-side-with-peers.md,
# "kiln's int8 linears become the default").
# A mode's weight compression and its activations' dynamic quantization group (on MatMulNBits' blocks
# of 32, larger int8 groups fall off the fast path; int4 takes the weights' group).
# f16 weights take no dynamic quantization: activations stay f32, as the recipe's accuracy asks.
WEIGHTS = {QuantMode.INT8.value: (WeightCompression.INT8.value, 128),
           QuantMode.INT4.value: (WeightCompression.Q4_1_AUGMENTED.value, 32),
           QuantMode.F16.value: (WeightCompression.F16.value, 0)}
KILN_INT8 = OpenVinoOptions(inference_precision="f32", kv_cache_precision="u8", key_cache_quant_mode=KILN_INT8_KEYS,
                            weights=WeightCompression.INT8.value, dynamic_quantization_group_size=128,
                            kernels=native.KERNELS)


def options_for_recipe(recipe: QuantRecipe) -> OpenVinoOptions:
    """fp32 keeps f32 compute and an f32 cache, so HF parity tolerances hold. int8 takes NNCF's
    per-channel symmetric weights and activations in groups of 128 (on MatMulNBits' blocks of 32,
    larger groups fall off the fast path). Its compute follows the build CPU (the recipe's compute,
    kiln/compiler/openvino_recipes.py): where it computes bf16 natively, bf16 with a u8 cache (the plugin's own
    default there; a 512-token prefill takes less CPU time than under f32 compute, 32 decodes as
    much or a little more, for slightly more perplexity), elsewhere f32 with an f16 cache (f32
    compute reads it; the u8 cache's per-token dequantization costs f32 compute more than its bytes
    save: 32 decodes took longer). A bf16 cache is what the plugin makes of an f16 one under bf16
    compute; u8 holds twice the tokens in the same memory. int4 takes the layers' linears
    as Q4_1 blocks (exact on a Q4_1 source) in the augmented form (weights.py), bf16 compute (TTFT
    and batched decodes ahead of f32 for a little more check perplexity), a u8 cache and activations
    in groups of 32 (the weights' group); the engine then takes less CPU time per decode than
    OpenVINO reading kiln's block-offset MatMulNBits. f16 stores every weight as f16, f32 compute
    over an f16 cache, activations unquantized (openvino_recipes.py says why).
    The measurements behind each choice: docs/benchmarks.md (`python bench/bench_openvino_calls.py`)
    and docs/results/2026-12-06-figures-from-code-comments.md."""
    if recipe.mode == QuantMode.NONE.value:
        return OpenVinoOptions()
    if recipe.mode not in WEIGHTS:
        raise ValueError(f"the openvino backend has no {recipe.mode} mode; use --quant int8 (OpenVINO "
                         f"quantizes activations itself: dynamic quantization, recorded in the artifact)")
    weights, groups = WEIGHTS[recipe.mode]
    kiln_linears = uses_kiln_linears(recipe)
    keys = (KILN_INT8_KEYS if kiln_linears else U8_KEYS) if recipe.kv_cache == "u8" else ""
    return OpenVinoOptions(inference_precision=recipe.compute, kv_cache_precision=recipe.kv_cache,
                           key_cache_quant_mode=keys, weights=weights, dynamic_quantization_group_size=groups,
                           kernels=native.KERNELS if kiln_linears else "")


def options_for_quant(quant: QuantMode, native_bf16: bool | None = None,
                      kiln_kernels: bool | None = None) -> OpenVinoOptions:
    """options_for_recipe of the openvino recipe for `quant`: native_bf16 and kiln_kernels as given,
    or (None) as the build plan has them for this host."""
    if native_bf16 is None or kiln_kernels is None:
        from kiln.compiler.defaults import openvino_int8_runs_kiln_linears
        from kiln.compiler.plan import BuildHost

        host = BuildHost.probe()
        native_bf16 = computes_bf16(host.cpu) if native_bf16 is None else native_bf16
        kiln_kernels = openvino_int8_runs_kiln_linears(host) if kiln_kernels is None else kiln_kernels
    if quant is not QuantMode.NONE and quant.value not in WEIGHTS:
        return options_for_recipe(QuantRecipe(quant.value, "backend"))      # refused there, with what to use
    return options_for_recipe(openvino_recipe(quant, native_bf16, kiln_kernels))
