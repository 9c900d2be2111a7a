"""The openvino backend's quantization recipes as data (backends/openvino/recipe.py turns one into the
plugin's options; the figures behind each choice are there and in docs/benchmarks.md).

- INT8 with kiln's linears (kiln/engines/openvino/native: AVX-512 VNNI, AMX tiles where the CPU has
  them, the library built):
  the layers' linears and the LM head on kiln.LinearI8 / kiln.GateUpI8, activations smoothed and
  quantized per row inside the operation, so the rest of the graph computes f32 (bf16 would put
  two reorders around each of kiln's nodes); the embedding NNCF int8 per channel.
- INT8 on the plugin's own: NNCF's per-channel symmetric int8, activations int8 in groups of 128,
  bf16 compute where the CPU computes bf16 natively, f32 elsewhere.
- INT4: the layers' linears as Q4_1 blocks in the augmented form (weights.py), bf16 compute; the
  embedding and the LM head NNCF int8 per channel.
- F16: every weight f16 (OpenVINO's own compression as it saves the model), f32 compute and an f16
  cache: the ladder's rung after every int8 rung failed, so accuracy first (bf16 compute would keep
  fewer bits of each activation than the weights keep), with half fp32's bytes to read.
"""

from __future__ import annotations

from kiln.compiler.plan import ROLES, Kernel, QuantRecipe, RoleKernel
from kiln.contract.cpu import HostCPU
from kiln.contract.quant import QuantMode

INT8_SYM = "int8_sym"                 # kiln.compiler.backends.openvino.weights.WeightCompression values
F16 = "f16"
Q4_1_AUGMENTED = "q4_1_g32_aug"
KILN_LINEAR, KILN_GATE_UP = "kiln.LinearI8", "kiln.GateUpI8"
# Flags under which the CPU plugin computes bf16 natively (its OPTIMIZATION_CAPABILITIES says BF16):
# AVX-512 BF16, AMX, or AVX2 with VNNI-INT8 and NE-convert.
BF16_FLAG_SETS = (("avx512_bf16",), ("amx_bf16",), ("avx_ne_convert", "avx_vnni_int8"))


def computes_bf16(cpu: HostCPU) -> bool:
    return any(cpu.has(*flags) for flags in BF16_FLAG_SETS)


def openvino_recipe(mode: QuantMode, bf16: bool, kiln_linears: bool, paged: bool = True) -> QuantRecipe:
    """bf16: the build CPU computes bf16 natively (computes_bf16); kiln_linears: the CPU and the library
    take kiln's int8 linears; paged: the model runs on the plugin's paged attention (kiln's linears
    take that layout only, not kiln's paged gather)."""
    if mode is QuantMode.NONE:
        return QuantRecipe(mode.value, "none", (), compute="f32", kv_cache="f32")
    if mode is QuantMode.F16:
        return _f16()
    if mode is QuantMode.INT8 and kiln_linears and paged:
        return _kiln_int8()
    if mode is QuantMode.INT8 and kiln_linears:
        return _own_int8("f32", "u8", "f32 compute and a u8 cache as kiln's int8 recipe has: its linears take "
                         "the paged layout only, not kiln's paged gather")
    if mode is QuantMode.INT8:
        if bf16:
            return _own_int8("bf16", "u8", "bf16 compute (this CPU computes bf16 natively) and a u8 cache")
        return _own_int8("f32", "f16", "f32 compute (this CPU has no native bf16) and an f16 cache")
    q4 = Kernel("openvino", 4, 32, weights=Q4_1_AUGMENTED, activations="int8")
    why = "Q4_1 blocks of 32 (exact on a Q4_1 source) in the augmented form the plugin's int8 kernel runs"
    roles = tuple(RoleKernel(role, q4, why) for role in ("qkv", "o", "gate_up", "down"))
    head = RoleKernel("lm_head", NNCF_INT8, "NNCF int8 per channel: 4-bit blocks there cost the most perplexity")
    return QuantRecipe(mode.value, "backend", (*roles, head, EMBEDDING), compute="bf16", kv_cache="u8")


NNCF_INT8 = Kernel("openvino", 8, weights=INT8_SYM)
EMBEDDING = RoleKernel("embedding", NNCF_INT8, "NNCF int8 per channel")


def _kiln_int8() -> QuantRecipe:
    linear = Kernel(KILN_LINEAR, 8, activations="uint8")
    why = ("kiln's int8 linear: activations smoothed (SmoothQuant, calibrated at build) and quantized "
           "per row inside the op, AVX-512 VNNI (AMX tiles on a CPU with them)")
    roles = (RoleKernel("qkv", linear, why), RoleKernel("o", linear, why),
             RoleKernel("gate_up", Kernel(KILN_GATE_UP, 8, activations="uint8"),
                        "kiln's gated pair: silu(x Wg) * x Wu in one op, activations as its linears'"),
             RoleKernel("down", linear, why), RoleKernel("lm_head", linear, why), EMBEDDING)
    return QuantRecipe("int8", "backend", roles, compute="f32", kv_cache="u8")


def _f16() -> QuantRecipe:
    kernel = Kernel("openvino", 16, weights=F16)
    why = "f16 weights (OpenVINO's own compression), f32 compute: half fp32's bytes, 11 significant bits of each"
    roles = tuple(RoleKernel(role, kernel, why) for role in ROLES)
    return QuantRecipe(QuantMode.F16.value, "backend", roles, compute="f32", kv_cache="f16")


def _own_int8(compute: str, kv_cache: str, why: str) -> QuantRecipe:
    kernel = Kernel("openvino", 8, weights=INT8_SYM, activations="int8")
    why = f"NNCF's per-channel symmetric int8, activations int8 in groups of 128; {why}"
    roles = tuple(RoleKernel(role, kernel, why) for role in ("qkv", "o", "gate_up", "down", "lm_head"))
    return QuantRecipe("int8", "backend", (*roles, EMBEDDING), compute=compute, kv_cache=kv_cache)


def uses_kiln_linears(recipe: QuantRecipe) -> bool:
    return bool(recipe.ops() & {KILN_LINEAR, KILN_GATE_UP})
