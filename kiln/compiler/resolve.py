"""resolve(config, spec, host) -> BuildPlan: every choice of a build, made once, before any stage runs.

Pure: the machine comes in as a BuildHost (kiln.compiler.plan; `BuildHost.probe()` reads this one),
so a test resolves for any CPU class. `fallbacks(plan)` gives the plans the build moves to, in
order, when the one before fails the engine's quantization check: the ladder a later rung joins.
"""

from __future__ import annotations

from dataclasses import replace

from kiln.compiler.defaults import (AUTO, choose_attention, choose_backend, choose_quant,
                                    openvino_int8_runs_kiln_linears, openvino_kiln_attention)
from kiln.compiler.openvino_recipes import computes_bf16, openvino_recipe, uses_kiln_linears
from kiln.compiler.passes.fusion import planned_fusions
from kiln.compiler.plan import BuildHost, BuildPlan, Choice, Fallback, QuantRecipe
from kiln.compiler.recipes import keep_sensitive_fp32, quant_recipe
from kiln.config import BuildConfig
from kiln.contract.backends import BACKEND_OPTIONS, get_backend
from kiln.contract.model_spec import ModelSpec
from kiln.contract.quant import QuantMode
from kiln.engines.ort import native as ort_native


def resolve(config: BuildConfig, spec: ModelSpec, host: BuildHost) -> BuildPlan:
    """The plan for building `spec` with `config` on `host`: `auto` backend, quant and attention
    replaced by their choice, each with its reason, and what every linear runs on."""
    modes = get_backend(config.backend).quant_modes if config.backend != AUTO else ()
    quant = choose_quant(config.quant, spec, modes)
    mode = QuantMode(quant.value)
    backend = _backend(config, mode, spec, host)
    attention = choose_attention(config.attention, backend.value, config.kv_dtype, host, spec)
    recipe = _recipe(backend.value, mode, spec, host)
    kiln_attention = openvino_kiln_attention(host, spec) if backend.value == "openvino" else ""
    if attention.chosen_by == AUTO and uses_kiln_linears(recipe) and kiln_attention:
        attention = Choice("native", AUTO, kiln_attention)
    fusions = planned_fusions(get_backend(backend.value).skipped_fusions, mode.value, config.fuse)
    # another backend refuses the option itself (kiln.compiler.build), saying which backend takes it
    takes_prefill = config.prefill_engine and "prefill_engine" in get_backend(backend.value).options
    prefill = (quant_recipe(get_backend(backend.value), QuantMode(config.prefill_engine), spec, host)
               if takes_prefill else None)
    return BuildPlan(backend, quant, attention, _kv_dtype(config, backend.value, recipe, attention), fusions, recipe,
                     host, prefill)


def _backend(config: BuildConfig, mode: QuantMode, spec: ModelSpec, host: BuildHost) -> Choice:
    ort_options = tuple(o for o, neutral in BACKEND_OPTIONS.items() if getattr(config, o) != neutral)
    return choose_backend(config.backend, mode, spec, host, ort_options)


def fallbacks(plan: BuildPlan, config: BuildConfig, spec: ModelSpec) -> tuple[Fallback, ...]:
    """The ladder after `plan`, in order: each rung more accurate than the one before and still the
    fastest such engine, ending in fp32 weights, so that a default build does not fail on a model a
    later rung passes. Where kiln's int8 linears run, OpenVINO's own next; then the ort backend at the
    same mode (blocks of 32 where OpenVINO's int8 is per channel); int8 where the mode was coarser;
    int8 with the sensitive tensors (the LM head, the embedding, the first and last layers) kept fp32;
    f16 weights where a backend the user allows builds them (OpenVINO: half fp32's bytes to read, so
    faster than fp32 and still almost exact); last, fp32 weights. The build takes a rung only where it
    changes nothing the user chose (Fallback.allowed_after); the first it may not take is named in the
    failure."""
    mode = QuantMode(plan.quant.value)
    rungs = [_openvino_own(plan)] if uses_kiln_linears(plan.recipe) else []
    if mode is QuantMode.NONE:
        return tuple(rungs)
    if mode is QuantMode.F16:
        return (_fp32(plan, config, spec),)
    if plan.backend.value == "openvino":
        rungs.append(_on_ort(plan, config, spec, mode))
    if plan.backend.value in ("openvino", "ort"):
        if mode is not QuantMode.INT8:
            rungs.append(_on_ort(plan, config, spec, QuantMode.INT8))
        rungs.append(_sensitive_fp32(plan, _on_ort(plan, config, spec, QuantMode.INT8).plan, spec))
    rungs += [r for r in (_f16_weights(plan, config, spec),) if r is not None]
    rungs.append(_fp32(plan, config, spec))
    return tuple(rungs)


def _openvino_own(plan: BuildPlan) -> Fallback:
    own = openvino_recipe(QuantMode(plan.quant.value), computes_bf16(plan.host.cpu), kiln_linears=False)
    kv = (plan.kv_dtype if plan.attention.value == "native"      # kiln's attention keeps its own cache
          else Choice(own.kv_cache, plan.kv_dtype.chosen_by, _openvino_kv_reason(own)))
    return Fallback(replace(plan, recipe=own, kv_dtype=kv, rung="openvino's own int8 linears"),
                    stage="the next rung: building on OpenVINO's own int8 linears",
                    reason="kiln's int8 linears failed the build's check ({failure}), so OpenVINO's own")


def _on_ort(plan: BuildPlan, config: BuildConfig, spec: ModelSpec, mode: QuantMode) -> Fallback:
    """The ort backend at `mode`: its int8 is in blocks of 32 (kiln's MatMulQ8 or MatMulNBits)."""
    rung = resolve(replace(config, backend="ort", quant=mode), spec, plan.host)
    backend = _relabelled(plan.backend, rung.backend, "ONNX Runtime: the next rung of the ladder")
    quant = _relabelled(plan.quant, rung.quant, f"{mode.value} weights: the next rung of the ladder")
    changes = tuple(what for what, a, b in (("backend", plan.backend, backend), ("quant", plan.quant, quant))
                    if a.value != b.value)
    label = f"ort {mode.value} ({rung.recipe.role('qkv').kernel.op}, blocks of 32)"
    return Fallback(replace(rung, backend=backend, quant=quant, rung=label),
                    stage=f"the next rung: {label}", reason=f"the rung before failed the build's check "
                    f"({{failure}}), so {label}", changes=changes, flags=f"--backend ort --quant {mode.value}")


def _sensitive_fp32(primary: BuildPlan, plan: BuildPlan, spec: ModelSpec) -> Fallback:
    """`plan` (the ort int8 rung) with the LM head, the embedding and the first and last layers fp32."""
    recipe = keep_sensitive_fp32(plan.recipe, spec)
    label = f"ort {plan.quant.value}, the LM head, embedding and layers {', '.join(map(str, recipe.fp32_layers))} fp32"
    quant = Choice(plan.quant.value, AUTO, f"{plan.quant.value} weights but the tensors a quantization error "
                   "hurts most, kept fp32: the next rung of the ladder")
    return Fallback(replace(plan, recipe=recipe, quant=quant, rung=label), stage=f"the next rung: {label}",
                    reason=f"the rung before failed the build's check ({{failure}}), so {label}",
                    changes=("quant",) + (("backend",) if primary.backend.value != "ort" else ()))


def _f16_weights(plan: BuildPlan, config: BuildConfig, spec: ModelSpec) -> Fallback | None:
    """f16 weights, on the backend the user named or the auto choice for f16 (OpenVINO, where it runs
    the model); None where that backend does not build them (ort: kiln.contract.backends says why)."""
    if get_backend(_backend(config, QuantMode.F16, spec, plan.host).value).refuses(QuantMode.F16.value):
        return None
    rung = resolve(replace(config, quant=QuantMode.F16), spec, plan.host)
    return _whole_mode(plan, rung, f"{rung.backend.value} f16 weights", "f16 weights: every int8 rung failed the "
                       "build's check, and 16-bit weights change almost nothing (half fp32's bytes to read)")


def _fp32(plan: BuildPlan, config: BuildConfig, spec: ModelSpec) -> Fallback:
    """fp32 weights, on the backend the user named or the auto choice for fp32: exact, so it passes."""
    rung = resolve(replace(config, quant=QuantMode.NONE), spec, plan.host)
    return _whole_mode(plan, rung, f"{rung.backend.value} fp32", "fp32 weights: every quantized rung failed the "
                       "build's check")


def _whole_mode(plan: BuildPlan, rung: BuildPlan, label: str, why: str) -> Fallback:
    """`rung` (a plan resolved at one mode for every weight) as the ladder's step after `plan`."""
    quant = Choice(rung.quant.value, AUTO, why)
    changes = ("quant",) + (("backend",) if rung.backend.value != plan.backend.value else ())
    flags = f"--quant {rung.quant.value}" + (f" --backend {rung.backend.value}" if "backend" in changes else "")
    return Fallback(replace(rung, quant=quant, rung=label), stage=f"the next rung: {label}",
                    reason=f"the rung before failed the build's check ({{failure}}), so {label}", changes=changes,
                    flags=flags)


def _relabelled(primary: Choice, rung: Choice, reason: str) -> Choice:
    """The rung's choice as the ladder made it: the primary's where unchanged, else kiln's with `reason`."""
    return primary if primary.value == rung.value else Choice(rung.value, AUTO, reason)


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


def _kv_dtype(config: BuildConfig, backend: str, recipe: QuantRecipe, attention: Choice) -> Choice:
    if backend == "openvino" and attention.value == "native":
        return Choice("u8", AUTO, "kiln's u8 cache (codes with a scale and a minimum per token and head), which "
                      "its paged attention reads")
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


def refuse_before_export(plan: BuildPlan, spec: ModelSpec) -> None:
    """What cannot work, refused before the export and the passes spend their time: a backend the
    user named that cannot run here or does not cover the model, and a recipe whose ops this build
    host lacks (the auto choices never pick these; a named one would fail only at compile or load)."""
    if plan.backend.value == "openvino":
        _refuse_openvino(plan, spec)
    if plan.recipe.ops() & NATIVE_OPS and not plan.host.ort_ops:
        raise ValueError(f"the {plan.recipe.mode} recipe runs on kiln's op library, which is not built here: "
                         f"run `{ort_native.BUILD_COMMAND}`")
    if plan.attention.value == "native":
        _refuse_native_attention(plan)


def _refuse_native_attention(plan: BuildPlan) -> None:
    """--attention native runs kiln's paged attention op, from the op library of the plan's backend."""
    from kiln.engines.openvino import native as ov_native

    built, command = ((plan.host.openvino_ops, ov_native.BUILD_COMMAND) if plan.backend.value == "openvino"
                      else (plan.host.ort_ops, ort_native.BUILD_COMMAND))
    if not built:
        raise ValueError(f"--attention native runs kiln's paged attention op on {plan.backend.value}, and kiln's op "
                         f"library for it is not built here: run `{command}`, or build without --attention native")


def _refuse_openvino(plan: BuildPlan, spec: ModelSpec) -> None:
    from kiln.compiler.backends.openvino.coverage import uncovered

    if not plan.host.openvino:
        raise ValueError("--backend openvino needs the openvino package, which is not installed here "
                         "(it comes with `pip install kiln`)")
    missing = uncovered(spec)
    if missing:
        raise ValueError(f"the openvino backend does not cover {missing} yet; build with --backend ort")


NATIVE_OPS = frozenset({"kiln.MatMulQ8", "kiln.MatMulQ4Min"})
