"""resolve(config, spec, host) -> BuildPlan: every choice of a build, made once, before any stage runs.

Pure: the machine comes in as a BuildHost (kiln.compiler.plan; `BuildHost.probe()` reads this one),
so a test resolves for any CPU class. `fallbacks(plan)` gives the plans the build moves to, in
order, when the one before fails the engine's quantization check: the ladder a later rung joins.
"""

from __future__ import annotations

from dataclasses import replace

from kiln.compiler.defaults import AUTO, choose_attention, choose_backend, choose_quant, openvino_int8_runs_kiln_linears
from kiln.compiler.openvino_recipes import computes_bf16, openvino_recipe, uses_kiln_linears
from kiln.compiler.passes.fusion import planned_fusions
from kiln.compiler.plan import BuildHost, BuildPlan, Choice, Fallback, QuantRecipe
from kiln.compiler.recipes import quant_recipe
from kiln.config import BuildConfig
from kiln.contract.backends import BACKEND_OPTIONS, get_backend
from kiln.contract.model_spec import ModelSpec
from kiln.contract.quant import QuantMode


def resolve(config: BuildConfig, spec: ModelSpec, host: BuildHost) -> BuildPlan:
    """The plan for building `spec` with `config` on `host`: `auto` backend, quant and attention
    replaced by their choice, each with its reason, and what every linear runs on."""
    modes = get_backend(config.backend).quant_modes if config.backend != AUTO else ()
    quant = choose_quant(config.quant, spec, modes)
    mode = QuantMode(quant.value)
    ort_options = tuple(o for o, neutral in BACKEND_OPTIONS.items() if getattr(config, o) != neutral)
    backend = choose_backend(config.backend, mode, spec, host, ort_options)
    attention = choose_attention(config.attention, backend.value, config.kv_dtype, host, spec)
    recipe = _recipe(backend.value, mode, spec, host)
    fusions = planned_fusions(get_backend(backend.value).skipped_fusions, mode.value, config.fuse)
    prefill = (quant_recipe(get_backend(backend.value), QuantMode(config.prefill_engine), spec, host)
               if config.prefill_engine else None)
    return BuildPlan(backend, quant, attention, _kv_dtype(config, backend.value, recipe), fusions, recipe, host,
                     prefill)


def fallbacks(plan: BuildPlan) -> tuple[Fallback, ...]:
    """The plans after `plan`, in order: where kiln's int8 linears fail the check, OpenVINO's own
    (a default build must not fail on what the plugin's linears would pass)."""
    if not uses_kiln_linears(plan.recipe):
        return ()
    own = openvino_recipe(QuantMode(plan.quant.value), computes_bf16(plan.host.cpu), kiln_linears=False)
    kv = Choice(own.kv_cache, plan.kv_dtype.chosen_by, _openvino_kv_reason(own))
    return (Fallback(replace(plan, recipe=own, kv_dtype=kv, rung="openvino's own int8 linears"),
                     stage="kiln's int8 linears failed the check ({failure}): building on OpenVINO's own",
                     reason="kiln's int8 linears failed the build's check ({failure}), so OpenVINO's own"),)


def apply_to_config(config: BuildConfig, plan: BuildPlan) -> BuildConfig:
    """The config with the plan's choices in place of `auto` (what the backends' builders read)."""
    return replace(config, quant=QuantMode(plan.quant.value), backend=plan.backend.value,
                   attention=plan.attention.value)


def _recipe(backend: str, mode: QuantMode, spec: ModelSpec, host: BuildHost) -> QuantRecipe:
    kiln_linears, paged = False, True
    if backend == "openvino" and mode is QuantMode.INT8:
        from kiln.compiler.backends.openvino.coverage import attention_core

        kiln_linears = openvino_int8_runs_kiln_linears(host)
        paged = attention_core(spec)[0] != "paged-gather"
    return quant_recipe(get_backend(backend), mode, spec, host, kiln_linears, paged)


def _kv_dtype(config: BuildConfig, backend: str, recipe: QuantRecipe) -> Choice:
    if backend == "openvino":
        return Choice(recipe.kv_cache or "f32", AUTO, _openvino_kv_reason(recipe))
    if "kv_dtype" not in get_backend(backend).options:
        return Choice(config.kv_dtype, AUTO, f"the {backend} backend keeps its own KV cache")
    if config.kv_dtype != BACKEND_OPTIONS["kv_dtype"]:
        return Choice(config.kv_dtype, "user", "--kv-dtype " + config.kv_dtype)
    return Choice(config.kv_dtype, AUTO, "fp32: exact, and what kiln's PagedAttention reads")


def _openvino_kv_reason(recipe: QuantRecipe) -> str:
    if not recipe.kv_cache or recipe.kv_cache == "f32":
        return "f32 with f32 compute: fp32 engines keep HF parity"
    return f"the plugin's cache for the {recipe.mode} recipe ({recipe.compute} compute)"
