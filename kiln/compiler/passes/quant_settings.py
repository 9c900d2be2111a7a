"""The quantize pass's settings (passes/quantize.py: QuantizePass) as one frozen value.

It takes the mode's defaults where a setting is left None and refuses what the pass cannot do, once,
when it is made. A build makes it from its plan's recipe (quant_recipe.py: recipe_settings).
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.contract.quant import QuantMode


# The INT4 defaults, the ort backend's recipe without kiln's op library (kiln/compiler/recipes.py):
# MatMulNBits alone, no side path. The attention's linears (qkv, o) 4-bit with integer zero points
# from a calibrated search, the MLP (gate_up, down) and the embedding / LM head 8-bit. SmolLM2 perplexity
# over fp32 stays within a few percent and it answers Paris (the all-4-bit block-offset recipe before it
# came closer with many more nodes; all 4-bit searched far worse: docs/results/2026-11-29-the-int4-recipe.md,
# docs/results/2026-12-06-figures-from-code-comments.md); the measured splits and the same-run speed A/B
# are in int4_search.py.
_TABLE_BITS = {QuantMode.INT8: 8, QuantMode.INT4: 8, QuantMode.W8A8: 8}
# NOTE: after MergeProjections, v_proj lives inside qkv_proj: a name listed here keeps the whole
# fused projection at 8 bits.
_INT8_LINEARS: dict[QuantMode, tuple[str, ...]] = {
    QuantMode.INT8: (), QuantMode.INT4: ("gate_up_proj", "gate_proj", "up_proj", "down_proj"), QuantMode.W8A8: ()}
# How 4-bit linears round (INT4_ROUNDINGS): "block_offsets" (a float minimum per block on a side
# path, block_offsets.py), "min_max" (onnxruntime's quantizer), "search" (integer zero points from a
# weighted search, int4_search.py), "q4min" (a float minimum per block on kiln's own kernel,
# q4min_linear.py; needs the op library, kiln/engines/ort/native).
INT4_ROUNDINGS = ("block_offsets", "min_max", "search", "q4min")
_INT4_ROUNDING = {QuantMode.INT4: "search"}
# Which of these a build takes, per backend, mode and CPU, is the build plan's quantization recipe
# (kiln/compiler/recipes.py, with why); QuantizePass.for_recipe applies one.


# How 8-bit linears run (not the LM head): "dynamic" (the w8a8 mode) = DynamicQuantizeMatMul, int8 per output channel with
# activations quantized per call (passes/dynamic_int8.py: much faster than MatMulNBits from 8 rows
# up, no slower at 1); "nbits" = MatMulNBits blocks of 32; "q8" = kiln.MatMulQ8 (Q8_0 codes,
# activations rounded per block of 32 to q8_activations, so no outlier trouble: nbits_linears does
# not apply; needs the op library). The LM head stays MatMulNBits (unless head_kernel says): it
# shares its table with the embedding and runs only at the logits rows.
INT8_KERNELS = ("dynamic", "nbits", "q8")
# MatMulQ8's activations (QuantSettings q8_activations) -> its accuracy_level: int8 or int16 per block of 32.
Q8_ACCURACY_LEVELS = {"int8": 4, "int16": 2}
# How the LM head runs (QuantSettings head_kernel): MatMulNBits, or one of kiln's ops.
HEAD_KERNELS = ("nbits", "q8", "q4min")
# ...except these, whose input has outliers that one activation scale per call cannot hold: the
# MLP's down projection reads SiLU(gate)*up. SmolLM2 perplexity over fp32 (bench/bench_quant_ppl.py
# --fuse): down_proj dynamic, alone or with the rest, costs most of the loss; all but down_proj stays
# close (answers Paris); all MatMulNBits is closest but answers "L'Étoile" (fp32's first-token margin
# is thin). The figures: docs/results/2026-12-06-figures-from-code-comments.md.
NBITS_LINEARS = ("down_proj",)


@dataclass(frozen=True)
class QuantSettings:
    """What the quantize pass does to a graph. A None setting takes the mode's recipe; once made,
    each holds what the pass applies. A build sets them from its plan's recipe (quant_recipe.py).

    mode: the bits of the linears (QuantMode.NONE: the pass changes nothing).
    block_size: weights per quantization block along K; kiln's kernels take 32.
    quantize_embedding, quantize_lm_head: False keeps that table fp32.
    symmetric: MatMulNBits without zero points.
    table_bits: bits of the embedding and LM head.
    int8_linears: node-name segments (e.g. "down_proj") of linears kept at 8 bits. With table_bits,
        (4, ()) is pure int4.
    block_offsets: 4-bit linears keep a float minimum per block (passes/block_offsets.py). Given
        without int4_rounding it picks "block_offsets" or "min_max"; then it says which was picked.
    int8_kernel: how 8-bit linears run (INT8_KERNELS); None: "dynamic" in w8a8, else "nbits".
    nbits_linears: node-name segments of "dynamic" linears kept on MatMulNBits regardless.
    int4_rounding: INT4_ROUNDINGS; "search" weighs errors by the inputs of a run over the pass's
        calibration_ids (int4_calibration.py; without them: plain squared error).
    offset_linears: node-name segments (e.g. "layers.29") of 4-bit linears that keep block offsets
        whatever int4_rounding says (a mixed split).
    head_kernel: "nbits" (the LM head MatMulNBits at table_bits, sharing its table with the
        embedding), "q8" (8-bit on kiln.MatMulQ8) or "q4min" (4-bit on kiln.MatMulQ4Min); with
        either of kiln's, the embedding keeps a table of its own.
    q8_activations: what every kiln.MatMulQ8 quantizes its activations to, "int8" or "int16".
    weight_range: the "dynamic" linears' largest weight magnitude (None: what this CPU runs right,
        kiln/compiler/recipes.py w8a8_weight_range).
    fp32_linears: node-name segments (e.g. "layers.0") of linears left fp32.
    """

    mode: QuantMode
    block_size: int = 32
    quantize_embedding: bool = True
    quantize_lm_head: bool = True
    symmetric: bool = False
    table_bits: int | None = None
    int8_linears: tuple[str, ...] | None = None
    block_offsets: bool | None = None
    int8_kernel: str | None = None
    nbits_linears: tuple[str, ...] = NBITS_LINEARS
    int4_rounding: str | None = None
    offset_linears: tuple[str, ...] = ()
    head_kernel: str = "nbits"
    q8_activations: str = "int8"
    weight_range: int | None = None
    fp32_linears: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check("q8_activations", self.q8_activations, tuple(Q8_ACCURACY_LEVELS))
        _check("head_kernel", self.head_kernel, HEAD_KERNELS)
        self._set(int8_kernel=self.int8_kernel or ("dynamic" if self.mode is QuantMode.W8A8 else "nbits"))
        _check("int8_kernel", self.int8_kernel, INT8_KERNELS)
        self._set(int4_rounding=_int4_rounding(self.mode, self.int4_rounding, self.block_offsets))
        if self.uses_kiln_kernels() and self.block_size != 32:
            raise ValueError("kiln's kernels (int4_rounding='q4min', a 'q8' head or int8_kernel) take block_size=32 "
                             "(their block)")
        self._set(block_offsets=self.int4_rounding == "block_offsets",
                  table_bits=self.table_bits or _TABLE_BITS.get(self.mode),
                  int8_linears=tuple(_INT8_LINEARS.get(self.mode, ()) if self.int8_linears is None
                                     else self.int8_linears),
                  nbits_linears=tuple(self.nbits_linears), offset_linears=tuple(self.offset_linears),
                  fp32_linears=tuple(self.fp32_linears))

    def uses_kiln_kernels(self) -> bool:
        """Whether a 4-bit rounding, the LM head or the 8-bit linears run on kiln's ops (their block: 32)."""
        return "q4min" in (self.int4_rounding, self.head_kernel) or "q8" in (self.head_kernel, self.int8_kernel)

    def dynamic_weight_range(self) -> int:
        """weight_range, or (None) what this CPU runs right."""
        if self.weight_range is not None:
            return self.weight_range
        from kiln.compiler.recipes import w8a8_weight_range
        from kiln.contract.cpu import host

        return w8a8_weight_range(host())

    def _set(self, **resolved) -> None:
        for name, value in resolved.items():
            object.__setattr__(self, name, value)     # NOTE: frozen; only __post_init__ resolves


def _check(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, not {value!r}")


def _int4_rounding(mode: QuantMode, rounding: str | None, block_offsets: bool | None) -> str:
    if rounding is None and block_offsets is not None:
        rounding = "block_offsets" if block_offsets else "min_max"
    rounding = rounding or _INT4_ROUNDING.get(mode, "min_max")
    _check("int4_rounding", rounding, INT4_ROUNDINGS)
    return rounding
