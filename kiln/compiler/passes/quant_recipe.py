"""A build plan's quantization recipe (kiln.compiler.plan.QuantRecipe) as QuantizePass's settings.

The recipe says, per role, which kernel and format; the pass's settings say the same by node-name
segments and kernel names (quant_settings.py: INT8_KERNELS, HEAD_KERNELS, INT4_ROUNDINGS). Only what a
recipe sets differently from the mode's defaults is given, so the pass's record stays as it was.
"""

from __future__ import annotations

from kiln.compiler.passes.quant_settings import QuantSettings
from kiln.compiler.plan import ROLE_SEGMENTS, Kernel, QuantRecipe
from kiln.contract.quant import QuantMode

LAYER_ROLES = tuple(ROLE_SEGMENTS)
# A kiln or ORT op name -> the pass's name for it, for 8-bit linears and for the LM head.
INT8_KERNEL_OF = {"MatMulNBits": "nbits", "DynamicQuantizeMatMul": "dynamic", "kiln.MatMulQ8": "q8"}
HEAD_KERNEL_OF = {"MatMulNBits": "nbits", "kiln.MatMulQ8": "q8", "kiln.MatMulQ4Min": "q4min"}


def recipe_settings(recipe: QuantRecipe) -> QuantSettings:
    """The quantize pass's settings that apply `recipe`."""
    return QuantSettings(QuantMode(recipe.mode), **_options(recipe))


def _options(recipe: QuantRecipe) -> dict:
    """The settings beyond the mode's defaults that apply `recipe`."""
    if recipe.applied_by != "kiln":
        return {}
    layers = {role: recipe.role(role).kernel for role in LAYER_ROLES}
    options: dict = {}
    four = [k for k in layers.values() if k.bits == 4]
    eight = {role: k for role, k in layers.items() if k.bits == 8}
    if four:
        options["int4_rounding"] = "q4min" if four[0].op == "kiln.MatMulQ4Min" else four[0].rounding
    if recipe.mode == QuantMode.INT4.value:
        options["int8_linears"] = _segments(eight)
    options |= _int8_options(eight)
    head = recipe.role("lm_head").kernel
    if HEAD_KERNEL_OF.get(head.op, "nbits") != "nbits":
        options["head_kernel"] = HEAD_KERNEL_OF[head.op]
    return options | _fp32_options(recipe)


def _fp32_options(recipe: QuantRecipe) -> dict:
    """What a recipe keeps fp32 (kiln.compiler.recipes.keep_sensitive_fp32), as the pass's settings."""
    options: dict = {}
    if recipe.role("lm_head").kernel.op == "fp32":
        options["quantize_lm_head"] = False
    if recipe.role("embedding").kernel.op == "fp32":
        options["quantize_embedding"] = False
    if recipe.fp32_layers:
        options["fp32_linears"] = tuple(f"layers.{i}" for i in recipe.fp32_layers)
    return options


def _int8_options(eight: dict[str, Kernel]) -> dict:
    ops = {k.op for k in eight.values()}
    if "DynamicQuantizeMatMul" in ops:
        nbits = {role: k for role, k in eight.items() if k.op == "MatMulNBits"}
        limit = next(k.weight_range for k in eight.values() if k.op == "DynamicQuantizeMatMul")
        return {"int8_kernel": "dynamic", "nbits_linears": _segments(nbits), "weight_range": limit}
    if "kiln.MatMulQ8" in ops:
        acts = next(k.activations for k in eight.values() if k.op == "kiln.MatMulQ8")
        return {"int8_kernel": "q8", "q8_activations": acts}
    return {}


def _segments(roles: dict[str, Kernel]) -> tuple[str, ...]:
    return tuple(seg for role in LAYER_ROLES if role in roles for seg in ROLE_SEGMENTS[role])
