"""The quantization recipe of a build: per linear role, which kernel and format, and why.

Pure: the backend, the mode, the model and the build host (a kiln.compiler.plan.BuildHost) come in;
a QuantRecipe comes out, which the quantize pass (passes/quantize.py: QuantizePass.for_recipe) or the
backend (backends/openvino/recipe.py: options_for_recipe) applies. The measurements behind each
recipe: passes/quantize.py (the check's tolerances), passes/quant_settings.py (the INT4 split),
passes/q4min_linear.py, passes/dynamic_int8.py, backends/openvino/recipe.py and docs/benchmarks.md.

On the ort backend (Backend.cpu_int4_recipe):
- INT8: with kiln's op library, every linear and the LM head on kiln.MatMulQ8 (Q8_0 codes), its
  activations rounded per block of 32 to int8 where the CPU has VNNI (vpdpbusd: four products per
  lane per instruction) and to int16 where it has not (pmaddwd: twice an f32 FMA's products, where
  int8 gains little), which also keeps ~15 bits of each activation instead of 7. Without the
  library, MatMulNBits blocks of 32, and the build says how to get the faster kernel.
- INT4: with the library, every linear but the LM head 4-bit on kiln.MatMulQ4Min (Q4_1 exactly), the
  LM head 8-bit on kiln.MatMulQ8 (4-bit there loses the answer); the embedding keeps a table of its
  own. Without it, MatMulNBits alone: the attention's linears 4-bit with integer zero points from a
  calibrated search, the MLP and the tables 8-bit.
- W8A8: DynamicQuantizeMatMul (int8 per output channel, activations per call) but the MLP's down
  projection, whose input has outliers one activation scale per call cannot hold (MatMulNBits).
  The weights' range follows the CPU: full int8 with VNNI, 7 bits without (dynamic_int8.py).
Backends other than ONNX Runtime on CPU keep the all-4-bit block-offset recipe at INT4: TensorRT's
weight-only path takes 4-bit blocks only, and what the CPU recipe avoids was measured on ORT's CPU kernels.
"""

from __future__ import annotations

from dataclasses import replace

from kiln.compiler.openvino_recipes import computes_bf16, openvino_recipe
from kiln.compiler.plan import BuildHost, Kernel, QuantRecipe, RoleKernel
from kiln.contract.backends import Backend
from kiln.contract.cpu import HostCPU
from kiln.contract.model_spec import ModelSpec
from kiln.contract.quant import QuantMode
from kiln.engines.ort import native as ort_native
from kiln.engines.ort.int8_dot import FULL_RANGE, REDUCED_RANGE

LAYER_ROLES = ("qkv", "o", "gate_up", "down")
BLOCK = 32                  # MatMulNBits' blocks here, and the only block kiln's kernels take
FP32 = Kernel("fp32")


def quant_recipe(backend: Backend, mode: QuantMode, spec: ModelSpec, host: BuildHost,
                 openvino_kiln_linears: bool = False, paged: bool = True) -> QuantRecipe:
    """What `backend` at `mode` stores each role as. openvino_kiln_linears: an openvino int8 build takes
    kiln's linears (kiln.compiler.defaults.openvino_int8_runs_kiln_linears says where); paged: the
    model runs on OpenVINO's paged attention (openvino_recipes.openvino_recipe)."""
    if backend.refuses(mode.value):          # no recipe here would be what the mode says
        raise ValueError(backend.refuses(mode.value))
    if mode is QuantMode.NONE:
        return QuantRecipe(mode.value, "none", _all(FP32, "--quant none: fp32 weights"))
    if mode.value in backend.compresses_weights:
        return openvino_recipe(mode, computes_bf16(host.cpu), openvino_kiln_linears, paged)
    if not backend.cpu_int4_recipe:
        return _gpu_recipe(mode, spec)
    if mode is QuantMode.W8A8:
        return _w8a8_recipe(spec, host.cpu)
    if host.ort_ops:
        return _kiln_ops_recipe(mode, host.cpu)
    return _nbits_recipe(mode, spec)


def keep_sensitive_fp32(recipe: QuantRecipe, spec: ModelSpec) -> QuantRecipe:
    """`recipe` with the tensors a quantization error hurts most kept fp32: the LM head and the
    embedding (one table when tied: every logit and every input reads it) and the first and last
    layers (the first feeds every later one; the last writes straight into the logits)."""
    why = "kept fp32: the tensors a quantization error hurts most (the ladder's sensitive rung)"
    roles = tuple(RoleKernel(r.role, FP32, why) if r.role in ("lm_head", "embedding") else r for r in recipe.roles)
    layers = tuple(sorted({0, spec.num_layers - 1}))
    note = f"{recipe.note}; the LM head, the embedding and layers {', '.join(map(str, layers))} fp32".lstrip("; ")
    return replace(recipe, roles=roles, fp32_layers=layers, note=note)


def q8_activations(cpu: HostCPU) -> str:
    """MatMulQ8's activations on this CPU: int8 with VNNI (four products per lane per instruction),
    int16 without (pmaddwd: twice an f32 FMA's products, where int8 gains little)."""
    return "int8" if kernel_path(cpu) == "avx512vnni" else "int16"


def kernel_path(cpu: HostCPU) -> str:
    """The vector path kiln's ONNX Runtime kernels take on this CPU: avx512vnni | avx2 | scalar (no AMX path)."""
    if cpu.isa in ("avx512vnni", "amx"):
        return "avx512vnni"
    return "avx2" if cpu.isa in ("avx2", "avx512") else "scalar"


def w8a8_weight_range(cpu: HostCPU) -> int:
    """DynamicQuantizeMatMul's largest weight magnitude: full int8 only where VNNI is known
    (kiln/engines/ort/int8_dot.py: without it, full-range products saturate the kernel's int16 sums)."""
    return FULL_RANGE if cpu.vnni is True else REDUCED_RANGE


def _all(kernel: Kernel, reason: str) -> tuple[RoleKernel, ...]:
    return tuple(RoleKernel(role, kernel, reason) for role in ("qkv", "o", "gate_up", "down", "lm_head", "embedding"))


def _layers(kernel: Kernel, reason: str, roles: tuple[str, ...] = LAYER_ROLES) -> tuple[RoleKernel, ...]:
    return tuple(RoleKernel(role, kernel, reason) for role in roles)


def _shared_table(spec: ModelSpec, bits: int = 8) -> RoleKernel:
    """The embedding as GatherBlockQuantized, reading a tied MatMulNBits head's table (one copy)."""
    tied = spec.tie_word_embeddings
    return RoleKernel("embedding", Kernel("GatherBlockQuantized", bits, BLOCK, shared=tied),
                      "the tied LM head's quantized table, shared" if tied else f"{bits}-bit table")


def _nbits_head(bits: int = 8) -> RoleKernel:
    return RoleKernel("lm_head", Kernel("MatMulNBits", bits, BLOCK, activations="int8"),
                      f"{bits}-bit MatMulNBits: it shares its table with the embedding and runs only at the "
                      "logits rows")


def _kiln_ops_recipe(mode: QuantMode, cpu: HostCPU) -> QuantRecipe:
    library = ort_native.LIBRARY.name
    own_table = RoleKernel("embedding", Kernel("GatherBlockQuantized", 8, BLOCK),
                           "8-bit table of its own (the LM head runs on kiln's op)")
    if mode is QuantMode.INT8:
        acts = q8_activations(cpu)
        q8 = Kernel("kiln.MatMulQ8", 8, BLOCK, activations=acts)
        why = (f"kiln's MatMulQ8 (Q8_0 codes) with {acts} activations: what this CPU ({kernel_path(cpu)}) "
               "multiplies fastest")
        roles = (*_layers(q8, why), RoleKernel("lm_head", q8, why), own_table)
        note = (f"8-bit linears: kiln's MatMulQ8 kernel with {acts} activations on this CPU ({kernel_path(cpu)}), "
                f"the LM head too ({library})")
        return QuantRecipe(mode.value, "kiln", roles, note=note)
    q4 = Kernel("kiln.MatMulQ4Min", 4, BLOCK, activations="int8")
    head = RoleKernel("lm_head", Kernel("kiln.MatMulQ8", 8, BLOCK, activations="int8"),
                      "8-bit on kiln's MatMulQ8: 4-bit on MatMulQ4Min loses the answer")
    roles = (*_layers(q4, "kiln's MatMulQ4Min: 4-bit codes with a float minimum per block (Q4_1 exactly)"), head,
             own_table)
    return QuantRecipe(mode.value, "kiln", roles,
                       note=f"4-bit linears: kiln's MatMulQ4Min kernel, the LM head on its MatMulQ8 ({library})")


def _nbits_recipe(mode: QuantMode, spec: ModelSpec) -> QuantRecipe:
    missing = f"kiln's op library is not built (`{ort_native.BUILD_COMMAND}`)"
    if mode is QuantMode.INT8:
        roles = _layers(Kernel("MatMulNBits", 8, BLOCK, activations="int8"), f"MatMulNBits blocks of 32: {missing}")
        note = (f"8-bit linears: MatMulNBits: kiln's op library is not built, run `{ort_native.BUILD_COMMAND}` "
                "for its faster MatMulQ8")
        return QuantRecipe(mode.value, "kiln", (*roles, _nbits_head(), _shared_table(spec)), note=note)
    attention = _layers(Kernel("MatMulNBits", 4, BLOCK, rounding="search", activations="int8"),
                        f"4-bit, integer zero points from a calibrated search: {missing}", ("qkv", "o"))
    mlp = _layers(Kernel("MatMulNBits", 8, BLOCK, activations="int8"),
                  "8-bit: the MLP at 4 bits with integer zero points costs the most accuracy", ("gate_up", "down"))
    note = (f"4-bit linears: MatMulNBits (attention 4-bit, MLP 8-bit): kiln's op library is not built, "
            f"run `{ort_native.BUILD_COMMAND}` for the faster all-4-bit kernel")
    return QuantRecipe(mode.value, "kiln", (*attention, *mlp, _nbits_head(), _shared_table(spec)), note=note)


def _w8a8_recipe(spec: ModelSpec, cpu: HostCPU) -> QuantRecipe:
    limit = w8a8_weight_range(cpu)
    dynamic = Kernel("DynamicQuantizeMatMul", 8, activations="uint8", weight_range=limit)
    why = ("int8 per output channel, activations quantized per call: ORT's integer GEMM "
           + ("(full-range weights: this CPU has VNNI)" if limit == FULL_RANGE
              else "(7-bit weights: full range would saturate without VNNI)"))
    down = RoleKernel("down", Kernel("MatMulNBits", 8, BLOCK, activations="int8"),
                      "MatMulNBits: its input SiLU(gate)*up has outliers one activation scale per call cannot hold")
    return QuantRecipe(QuantMode.W8A8.value, "kiln",
                       (*_layers(dynamic, why, ("qkv", "o", "gate_up")), down, _nbits_head(), _shared_table(spec)))


def _gpu_recipe(mode: QuantMode, spec: ModelSpec) -> QuantRecipe:
    if mode is QuantMode.INT4:
        roles = _layers(Kernel("MatMulNBits", 4, BLOCK, rounding="block_offsets", activations="int8"),
                        "4-bit with a float minimum per block on a side path: exact on a Q4_1 source, and "
                        "the 4-bit blocks a GPU's weight-only path takes")
        return QuantRecipe(mode.value, "kiln", (*roles, _nbits_head(), _shared_table(spec)),
                           note="4-bit linears: MatMulNBits with block offsets")
    roles = _layers(Kernel("MatMulNBits", 8, BLOCK, activations="int8"), "MatMulNBits blocks of 32")
    return QuantRecipe(mode.value, "kiln", (*roles, _nbits_head(), _shared_table(spec)))
