"""The build plan (kiln.compiler.resolve): --backend / --quant / --attention auto and the quantization
recipe, resolved for CPU classes given as flags (kiln.contract.cpu.describe), on model specs (no build)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re

import pytest

from kiln.compiler.defaults import KILN_ATTENTION_ON_TILES, KILN_ATTENTION_ON_VNNI, choose_quant, kiln_int8_is_faster_here, parameter_count
from kiln.compiler.plan import BuildHost, BuildPlan
from kiln.compiler.resolve import apply_to_config, fallbacks, resolve
from kiln.config import BuildConfig
from kiln.contract.cpu import describe
from kiln.contract.model_spec import ModelSpec
from kiln.contract.quant import QuantMode
from kiln.engines.ort import native

HAS_OPENVINO = importlib.util.find_spec("openvino") is not None
needs_openvino = pytest.mark.skipif(not HAS_OPENVINO, reason="the openvino rows ask its coverage of the model")

AVX2 = {"avx", "avx2", "fma", "f16c"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512dq", "avx512vl"}
VNNI = AVX512 | {"avx512_vnni", "avx512_bf16"}               # AMD EPYC Zen 4, Intel Ice Lake / Cooper Lake
AMX = VNNI | {"amx_tile", "amx_int8", "amx_bf16"}            # Intel Sapphire Rapids
CPUS = {"avx2": AVX2, "avx512-vnni": VNNI, "amx": AMX}


def spec(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int) -> ModelSpec:
    return ModelSpec("llama", vocab, hidden, layers, heads, kv_heads, hidden // heads, intermediate, 1e-5, 1e4,
                     2048, tie_word_embeddings=True, attention_bias=False)


SMOLLM2 = spec(576, 30, 9, 3, 1536, 49152)
TINY = spec(64, 2, 4, 2, 128, 256)


def host(cpu: str, libraries: bool = True, machine: str = "x86_64") -> BuildHost:
    return BuildHost(describe(CPUS[cpu], machine), ort_ops=libraries, openvino_ops=libraries, openvino=True)


def plan_for(cpu: str, backend: str = "auto", quant: str | None = None, libraries: bool = True, **config) -> BuildPlan:
    mode = None if quant is None else QuantMode(quant)
    config = BuildConfig(source="x", out="x", backend=backend, quant=mode, **config)
    return resolve(config, SMOLLM2, host(cpu, libraries))


def ops(plan: BuildPlan) -> dict[str, str]:
    return {r.role: r.kernel.op for r in plan.recipe.roles}


Q8 = {"qkv": "kiln.MatMulQ8", "o": "kiln.MatMulQ8", "gate_up": "kiln.MatMulQ8", "down": "kiln.MatMulQ8",
      "lm_head": "kiln.MatMulQ8", "embedding": "GatherBlockQuantized"}
Q4 = {**Q8, **dict.fromkeys(("qkv", "o", "gate_up", "down"), "kiln.MatMulQ4Min")}
W8A8 = {"qkv": "DynamicQuantizeMatMul", "o": "DynamicQuantizeMatMul", "gate_up": "DynamicQuantizeMatMul",
        "down": "MatMulNBits", "lm_head": "MatMulNBits", "embedding": "GatherBlockQuantized"}
FP32 = dict.fromkeys(Q8, "fp32")
OV_INT8 = dict.fromkeys(Q8, "openvino")
OV_F16 = OV_INT8                                            # the plugin's own, every weight f16
KILN_OV = {"qkv": "kiln.LinearI8", "o": "kiln.LinearI8", "gate_up": "kiln.GateUpI8", "down": "kiln.LinearI8",
           "lm_head": "kiln.LinearI8", "embedding": "openvino"}

# cpu class, --backend, --quant (None: auto) -> backend, each role's op, the attention core, extra details.
TABLE = [
    ("avx2", "auto", None, "ort", Q8, "native", {"activations": "int16"}),
    ("avx2", "auto", "int8", "ort", Q8, "native", {"activations": "int16"}),
    ("avx2", "auto", "int4", "ort", Q4, "native", {}),
    ("avx2", "auto", "w8a8", "ort", W8A8, "native", {"weight_range": 63}),
    ("avx2", "auto", "none", "ort", FP32, "native", {}),
    ("avx2", "openvino", "int8", "openvino", OV_INT8, "auto", {"compute": "f32"}),
    ("avx2", "openvino", "int4", "openvino", OV_INT8, "auto", {"compute": "bf16"}),
    ("avx512-vnni", "auto", None, "openvino", KILN_OV, "native", {"compute": "f32"}),
    ("avx512-vnni", "openvino", "int8", "openvino", KILN_OV, "native", {"compute": "f32"}),
    ("avx512-vnni", "auto", "int4", "ort", Q4, "native", {}),
    ("avx512-vnni", "auto", "w8a8", "ort", W8A8, "native", {"weight_range": 127}),
    ("avx512-vnni", "auto", "none", "ort", FP32, "native", {}),
    ("avx512-vnni", "ort", "int8", "ort", Q8, "native", {"activations": "int8"}),
    ("avx512-vnni", "openvino", "none", "openvino", FP32, "auto", {}),
    ("amx", "auto", None, "openvino", KILN_OV, "native", {"compute": "f32"}),
    ("amx", "openvino", "int8", "openvino", KILN_OV, "native", {"compute": "f32"}),
    ("amx", "auto", "int4", "ort", Q4, "native", {}),
    ("amx", "auto", "w8a8", "ort", W8A8, "native", {"weight_range": 127}),
    ("amx", "ort", "int8", "ort", Q8, "native", {"activations": "int8"}),
    ("avx2", "auto", "f16", "openvino", OV_F16, "auto", {"compute": "f32"}),
    ("avx512-vnni", "openvino", "f16", "openvino", OV_F16, "auto", {"compute": "f32"}),
    ("amx", "auto", "f16", "openvino", OV_F16, "auto", {"compute": "f32"}),
]


@needs_openvino
@pytest.mark.parametrize("cpu, backend, quant, chosen, roles, attention, details", TABLE)
def test_the_plan_per_cpu_class_backend_and_quant(cpu, backend, quant, chosen, roles, attention, details):
    plan = plan_for(cpu, backend, quant)
    assert plan.backend.value == chosen
    assert ops(plan) == roles
    assert plan.attention.value == attention
    if "activations" in details:
        assert plan.recipe.role("qkv").kernel.activations == details["activations"]
        assert f"with {details['activations']} activations" in plan.recipe.note
    if "weight_range" in details:
        assert plan.recipe.role("qkv").kernel.weight_range == details["weight_range"]
    if "compute" in details:
        assert plan.recipe.compute == details["compute"]


@needs_openvino
def test_each_auto_backend_choice_says_why():
    assert "neither AVX-512 nor VNNI" in plan_for("avx2").backend.reason
    assert "MatMulQ8" in plan_for("avx2").backend.reason
    assert "kiln's int8 linears" in plan_for("avx512-vnni").backend.reason
    assert "kiln's int8 linears" in plan_for("amx").backend.reason
    # the reason names what the kernels multiply on: the AMX tiles where the CPU has them
    assert "AMX int8 tiles" in plan_for("amx").backend.reason and "AMX" not in plan_for("avx512-vnni").backend.reason
    assert "ort" == plan_for("avx512-vnni", quant="int4").backend.value       # ort measured faster at int4
    assert "where it measured fastest" in plan_for("avx512-vnni", quant="int4").backend.reason


def test_without_kilns_libraries_the_ort_recipes_run_on_matmulnbits():
    int8 = plan_for("avx2", "ort", "int8", libraries=False)
    assert set(ops(int8).values()) == {"MatMulNBits", "GatherBlockQuantized"}
    assert native.BUILD_COMMAND in int8.recipe.note and "for its faster MatMulQ8" in int8.recipe.note
    int4 = plan_for("avx2", "ort", "int4", libraries=False)
    assert [int4.recipe.role(r).kernel.bits for r in ("qkv", "o", "gate_up", "down", "lm_head")] == [4, 4, 8, 8, 8]
    assert int4.recipe.role("qkv").kernel.rounding == "search" and "attention 4-bit, MLP 8-bit" in int4.recipe.note
    assert int4.attention.value == "standard" and native.BUILD_COMMAND in int4.attention.reason


@needs_openvino
def test_without_kilns_libraries_int8_goes_to_openvinos_own_linears():
    """On AVX2 ort's int8 is faster only on kiln's kernel; without the library, OpenVINO again."""
    assert plan_for("avx2", libraries=False).backend.value == "openvino"
    assert ops(plan_for("avx512-vnni", libraries=False)) == OV_INT8
    # the reason says the default moved for a missing library, and how to build it
    assert native.BUILD_COMMAND in plan_for("avx2", libraries=False).backend.reason
    assert "kiln.engines.openvino.native.build" in plan_for("avx512-vnni", libraries=False).backend.reason
    assert ops(plan_for("amx", libraries=False)) == OV_INT8
    assert "kiln.engines.openvino.native.build" in plan_for("amx", libraries=False).backend.reason


@needs_openvino
def test_the_openvino_int8_default_takes_kiln_attention_where_its_kernels_run():
    plan = plan_for("amx")
    assert plan.attention.to_dict() == {"value": "native", "chosen_by": "auto", "reason": KILN_ATTENTION_ON_TILES}
    assert plan.kv_dtype.value == "u8" and "kiln's u8 cache" in plan.kv_dtype.reason
    assert "native" == apply_to_config(BuildConfig(source="x", out="x"), plan).attention
    # on AVX-512 VNNI without tiles, its prefill and decodes on int8 products over the u8 codes
    vnni = plan_for("avx512-vnni")
    assert vnni.attention.to_dict() == {"value": "native", "chosen_by": "auto", "reason": KILN_ATTENTION_ON_VNNI}
    assert vnni.kv_dtype.value == "u8"
    # not where the library is missing, the user chose, or the heads do not fit the tiles (48 values)
    assert plan_for("amx", libraries=False).attention.value == "auto"
    assert plan_for("avx512-vnni", libraries=False).attention.value == "auto"
    for cpu in ("amx", "avx512-vnni"):
        chosen = plan_for(cpu, backend="openvino", attention="standard")
        assert (chosen.backend.value, chosen.attention.value) == ("openvino", "standard")
    odd_heads = resolve(BuildConfig(source="x", out="x"), spec(576, 30, 12, 3, 1536, 49152), host("amx"))
    assert odd_heads.backend.value == "openvino" and odd_heads.attention.value == "auto"
    # OpenVINO's own int8 linears (the ladder's next rung) keep kiln's attention and its cache
    own = fallbacks(plan, BuildConfig(source="x", out="x"), SMOLLM2)[0]
    assert own.plan.attention.value == "native" and own.plan.kv_dtype == plan.kv_dtype


@pytest.mark.parametrize("backend", ["tensorrt", "ort-cuda"])
def test_gpu_backends_take_the_block_offset_int4_recipe(backend):
    plan = plan_for("avx512-vnni", backend, "int4")
    assert {plan.recipe.role(r).kernel.rounding for r in ("qkv", "o", "gate_up", "down")} == {"block_offsets"}
    assert plan.recipe.note == "4-bit linears: MatMulNBits with block offsets"
    assert plan.attention.value == "auto" and "its own paged attention" in plan.attention.reason


@needs_openvino
def test_openvino_skips_its_fusions_with_their_reasons():
    fusions = {f.name: f for f in plan_for("amx").fusions}
    assert not fusions["fuse_rotary"].applies and "RoPE" in fusions["fuse_rotary"].reason
    assert fusions["merge_projections"].applies and fusions["merge_projections"].without == ("mlp",)
    int4 = {f.name: f for f in plan_for("amx", "openvino", "int4").fusions}
    assert int4["merge_projections"].without == ()                       # gate/up split at int8 only
    assert all(f.applies for f in plan_for("amx", "ort", "int8").fusions)
    assert not any(f.applies for f in plan_for("amx", "ort", "int8", fuse=False).fusions)


def ladder(cpu: str, backend: str = "auto", quant: str | None = None, libraries: bool = True, **config):
    mode = None if quant is None else QuantMode(quant)
    config = BuildConfig(source="x", out="x", backend=backend, quant=mode, **config)
    plan = resolve(config, SMOLLM2, host(cpu, libraries))
    return plan, fallbacks(plan, config, SMOLLM2)


@needs_openvino
def test_the_fallback_ladder_after_kilns_int8_linears_is_openvinos_own():
    plan, rungs = ladder("avx512-vnni")
    step = rungs[0]
    taken = step.taken("top-1 0.5 < 0.9")
    assert ops(taken) == OV_INT8 and taken.recipe.compute == "bf16" and taken.kv_dtype.value == "u8"
    assert taken.backend.reason.endswith("; kiln's int8 linears failed the build's check (top-1 0.5 < 0.9), "
                                         "so OpenVINO's own")
    assert "building on OpenVINO's own" in step.stage and step.changes == ()


@needs_openvino
def test_the_default_ladder_runs_from_the_fastest_engine_to_fp32():
    plan, rungs = ladder("avx512-vnni")
    assert [(r.plan.backend.value, r.plan.quant.value, r.changes) for r in rungs] == [
        ("openvino", "int8", ()), ("ort", "int8", ("backend",)), ("ort", "int8", ("quant", "backend")),
        ("openvino", "f16", ("quant",)), ("ort", "none", ("quant", "backend"))]
    assert ops(rungs[1].plan) == Q8 and rungs[1].flags == "--backend ort --quant int8"
    sensitive = rungs[2].plan.recipe
    assert sensitive.fp32_layers == (0, 29) and ops(rungs[2].plan)["lm_head"] == ops(rungs[2].plan)["embedding"] == "fp32"
    assert ops(rungs[2].plan)["qkv"] == "kiln.MatMulQ8" and rungs[2].flags == ""
    assert ops(rungs[3].plan) == OV_F16 and rungs[3].flags == "--quant f16"
    assert ops(rungs[4].plan) == FP32 and rungs[4].flags == "--quant none --backend ort"
    assert all(r.allowed_after(plan) for r in rungs)
    _, amx = ladder("amx")                    # the same ladder: kiln's linears run on AMX tiles there
    assert [(r.plan.backend.value, r.plan.quant.value) for r in amx] == [(r.plan.backend.value, r.plan.quant.value)
                                                                        for r in rungs]
    _, no_library = ladder("amx", libraries=False)     # OpenVINO's own linears first: no kiln rung
    assert [r.plan.backend.value for r in no_library] == ["ort", "ort", "openvino", "ort"]


@needs_openvino
def test_the_f16_rung_comes_after_the_sensitive_int8_rung_and_before_fp32():
    plan, rungs = ladder("avx512-vnni")
    names = [r.name for r in rungs]
    assert names[-3:] == ["ort int8, the LM head, embedding and layers 0, 29 fp32", "openvino f16 weights", "ort fp32"]
    f16 = rungs[-2]
    assert f16.plan.recipe.mode == "f16" and f16.plan.recipe.compute == "f32" and f16.plan.kv_dtype.value == "f16"
    assert {r.kernel.bits for r in f16.plan.recipe.roles} == {16}
    assert {r.kernel.weights for r in f16.plan.recipe.roles} == {"f16"}
    assert f16.plan.quant.chosen_by == "auto" and "16-bit weights change almost nothing" in f16.plan.quant.reason
    taken = f16.taken("top-1 0.5 < 0.9")
    assert taken.backend.reason.endswith("the rung before failed the build's check (top-1 0.5 < 0.9), so openvino "
                                         "f16 weights")
    on_ort, ort_rungs = ladder("avx2")               # ort's int8 first: the f16 rung moves to openvino
    assert (on_ort.backend.value, ort_rungs[-2].name, ort_rungs[-2].flags) == (
        "ort", "openvino f16 weights", "--quant f16 --backend openvino")


def test_without_openvino_the_ladder_has_no_f16_rung():
    """The ort backend builds no f16 weights (kiln.contract.backends says why): fp32 follows int8."""
    no_openvino = dataclasses.replace(host("avx2"), openvino=False)
    config = BuildConfig(source="x", out="x")
    plan = resolve(config, SMOLLM2, no_openvino)
    assert [r.plan.quant.value for r in fallbacks(plan, config, SMOLLM2)] == ["int8", "none"]


@needs_openvino
def test_a_rung_that_changes_what_the_user_named_is_not_taken():
    plan, rungs = ladder("avx512-vnni", quant="int8")
    assert [r.allowed_after(plan) for r in rungs] == [True, True, False, False, False]
    plan, rungs = ladder("avx2", "ort", "int8")
    assert [r.name for r in rungs][-1] == "ort fp32" and not any(r.allowed_after(plan) for r in rungs)
    plan, rungs = ladder("avx2", "ort")              # the backend named, the quant auto: ort has no f16
    assert [r.allowed_after(plan) for r in rungs] == [True, True]
    plan, rungs = ladder("avx2", "openvino")         # openvino named: its f16 rung is taken
    assert [(r.name, r.allowed_after(plan)) for r in rungs][-2:] == [("openvino f16 weights", True),
                                                                     ("openvino fp32", True)]
    plan, rungs = ladder("avx2", "ort", "int4")
    assert [(r.plan.quant.value, r.flags) for r in rungs][0] == ("int8", "--backend ort --quant int8")
    assert ladder("avx2", "ort", "none")[1] == ()
    plan, rungs = ladder("avx2", quant="f16")        # an explicit f16 build's one rung: fp32, named on failure
    assert [(r.name, r.flags, r.allowed_after(plan)) for r in rungs] == [("ort fp32", "--quant none --backend ort",
                                                                        False)]


@pytest.mark.parametrize("backend, says", [
    ("ort", "ONNX Runtime's CPU linears take fp32 weights"),
    ("tensorrt", "--precision fp16 (the default) already stores and computes the weights in fp16"),
    ("ort-cuda", "build --quant none"),
])
def test_f16_is_refused_where_a_backend_does_not_build_it(tmp_path, backend, says):
    from kiln.compiler.build import build

    with pytest.raises(ValueError, match=f"the {backend} backend has no f16 mode: .*{re.escape(says)}"):
        build(BuildConfig(source="tiny-llama", out=tmp_path / "a", backend=backend, quant=QuantMode.F16))
    assert not (tmp_path / "a").exists()


def test_f16_with_the_auto_backend_and_no_openvino_is_refused_saying_where_it_builds():
    no_openvino = dataclasses.replace(host("avx2"), openvino=False)
    with pytest.raises(ValueError, match="f16 weights build on --backend openvino"):
        resolve(BuildConfig(source="x", out="x", quant=QuantMode.F16), SMOLLM2, no_openvino)


@needs_openvino
@pytest.mark.parametrize("cpu, backend, quant", [(c, b, q) for c, b, q, *_ in TABLE])
def test_a_plan_round_trips_through_its_dict(cpu, backend, quant):
    plan = plan_for(cpu, backend, quant, prefill_engine="w8a8" if backend == "ort" else "")
    assert BuildPlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan


def test_the_prefill_engine_has_its_recipe_in_the_plan():
    plan = plan_for("avx512-vnni", "ort", "int8", prefill_engine="w8a8")
    assert plan.prefill_recipe.mode == "w8a8" and plan.prefill_recipe.role("down").kernel.op == "MatMulNBits"
    assert plan_for("avx512-vnni", "ort", "int8").prefill_recipe is None


def test_parameter_count_of_smollm2_is_its_135m():
    assert 134e6 < parameter_count(SMOLLM2) < 136e6


def test_quant_auto_is_int8_for_a_real_model_and_fp32_for_a_tiny_one():
    assert choose_quant(None, SMOLLM2).value == "int8"
    assert choose_quant(None, TINY).value == "none"
    assert choose_quant(QuantMode.INT4, SMOLLM2).chosen_by == "user"


@pytest.mark.parametrize("flags,faster", [({"avx2", "fma"}, True), ({"avx2", "fma", "avx512f"}, False),
                                          ({"avx2", "fma", "avx_vnni"}, False), ({"sse4_2"}, False), (set(), False),
                                          (None, False)])
def test_which_cpus_run_int8_fastest_on_kilns_kernel(flags, faster):
    cpu = describe(flags)
    assert kiln_int8_is_faster_here(BuildHost(cpu, ort_ops=True)) is faster
    assert kiln_int8_is_faster_here(BuildHost(cpu, ort_ops=False)) is False       # no op library: no kernel


def test_backend_auto_falls_back_to_ort_and_says_why(monkeypatch):
    monkeypatch.setattr("kiln.compiler.backends.openvino.coverage.uncovered", lambda spec: "sliding-window attention")
    windowed = dataclasses.replace(SMOLLM2, sliding_window=4096)
    plan = resolve(BuildConfig(source="x", out="x", quant=QuantMode.INT8), windowed, host("amx"))
    assert plan.backend.value == "ort" and "sliding-window" in plan.backend.reason
    arm = resolve(BuildConfig(source="x", out="x", quant=QuantMode.INT8), SMOLLM2, host("avx2", machine="aarch64"))
    assert arm.backend.value == "ort" and "only on x86 (this is aarch64)" in arm.backend.reason
    missing = resolve(BuildConfig(source="x", out="x", quant=QuantMode.INT8), SMOLLM2,
                      dataclasses.replace(host("amx"), openvino=False))
    assert "openvino is not installed" in missing.backend.reason


def test_ort_only_options_narrow_auto_to_ort():
    plan = plan_for("amx", quant="int8", kv_dtype="float16")
    assert plan.backend.value == "ort" and "--kv-dtype" in plan.backend.reason
    assert plan.attention.value == "standard" and "fp32" in plan.attention.reason
    assert (plan.kv_dtype.value, plan.kv_dtype.chosen_by) == ("float16", "user")


def test_an_explicit_choice_wins():
    plan = plan_for("avx2", "ort", "int8", attention="gqa")
    assert (plan.backend.value, plan.backend.chosen_by) == ("ort", "user")
    assert plan.attention.to_dict() == {"value": "gqa", "chosen_by": "user", "reason": "--attention gqa"}


def test_quant_auto_respects_a_named_backends_modes():
    """tensorrt has no int8 weight-only path: auto gives it unquantized weights, not a refusal."""
    plan = plan_for("amx", "tensorrt")
    assert plan.quant.value == "none" and "no int8" in plan.quant.reason


@needs_openvino
def test_resolving_reads_nothing_of_this_machine(monkeypatch):
    """The plan is a function of its inputs: the host probes fail here, and every row still resolves."""
    from kiln.contract import cpu
    from kiln.engines.openvino import native as ov_native

    def probed(*args):
        raise AssertionError("resolve read the machine")

    for target, name in ((cpu, "host"), (cpu, "read_flags"), (BuildHost, "probe"), (native, "available"),
                         (native, "isa"), (ov_native, "available"), (ov_native, "cpu_flags")):
        monkeypatch.setattr(target, name, probed)
    for cpu_class, backend, quant, *_ in TABLE:
        plan_for(cpu_class, backend, quant)


def test_what_cannot_work_here_is_refused_before_the_export():
    from kiln.compiler.resolve import refuse_before_export

    no_openvino = BuildHost(describe(CPUS["avx512-vnni"], "x86_64"), ort_ops=True, openvino_ops=False, openvino=False)
    config = BuildConfig(source="x", out="x", backend="openvino", quant=QuantMode.INT8)
    with pytest.raises(ValueError, match="needs the openvino package"):
        refuse_before_export(resolve(config, SMOLLM2, no_openvino), SMOLLM2)
    plan = plan_for("avx2", "ort", "int8")                     # kiln's MatMulQ8, then the library is gone
    with pytest.raises(ValueError, match="kiln's op library, which is not built here"):
        refuse_before_export(dataclasses.replace(plan, host=dataclasses.replace(plan.host, ort_ops=False)), SMOLLM2)
    native_core = resolve(BuildConfig(source="x", out="x", attention="native"), SMOLLM2, host("avx2", libraries=False))
    with pytest.raises(ValueError, match="--attention native runs kiln's paged attention op on ort"):
        refuse_before_export(native_core, SMOLLM2)
    no_ov_ops = BuildHost(describe(CPUS["avx512-vnni"], "x86_64"), ort_ops=True, openvino_ops=False, openvino=True)
    ov_native = resolve(BuildConfig(source="x", out="x", backend="openvino", attention="native"), SMOLLM2, no_ov_ops)
    with pytest.raises(ValueError, match="paged attention op on openvino.*openvino.native.build"):
        refuse_before_export(ov_native, SMOLLM2)
    refuse_before_export(plan_for("avx2"), SMOLLM2)            # the auto choices always can


def test_a_build_refuses_before_it_exports(tmp_path):
    from kiln.compiler.build import build

    stages = []

    def stage(name):
        import contextlib

        stages.append(name)
        return contextlib.nullcontext()

    no_openvino = BuildHost(describe(CPUS["avx2"], "x86_64"), ort_ops=True, openvino_ops=False, openvino=False)
    with pytest.raises(ValueError, match="needs the openvino package"):
        build(BuildConfig(source="tiny-llama", out=tmp_path / "a", backend="openvino", quant=QuantMode.NONE),
              stage=stage, host=no_openvino)
    assert stages == ["load model source"] and not (tmp_path / "a").exists()
