"""Weight compression for the openvino backend: NNCF (OpenVINO's compression library) and kiln's Q4_1 blocks.

The CPU plugin runs a compressed weight as a decompression subgraph (u8/i4 constant, convert,
zero point, scale) folded into its matmul kernel. NNCF's per-channel int8 beat OpenVINO
reading kiln's own MatMulNBits int8 (blocks of 32) on prefill and decode (docs/benchmarks.md), so an
openvino build compresses the fp32 graph here instead of taking the quantize pass's output.
"""

from __future__ import annotations

import enum

import openvino as ov


class WeightCompression(enum.Enum):
    NONE = "none"
    # Per output channel, symmetric (no zero point): faster than NNCF's asymmetric default, above
    # all at 32 decodes past 300 tokens, for slightly more perplexity (docs/benchmarks.md and
    # docs/results/2026-12-06-figures-from-code-comments.md).
    INT8 = "int8_sym"
    INT4 = "int4_sym_g32"            # symmetric, groups of 32 (SmolLM2's 576 is no multiple of 128);
                                     # embedding and LM head stay int8 (NNCF's backup precision)
    # The layers' linears as Q4_1 blocks (w = d·q + m per group of 32: q4_weights.py), exact on a
    # Q4_1 source (the SmolLM2 GGUF); the embedding and the LM head NNCF int8 per channel (4-bit
    # min/max blocks there cost much more perplexity on the check text: the figure is in
    # docs/results/2026-12-06-figures-from-code-comments.md).
    # AUGMENTED (the int4 recipe): i4 codes with the block offsets as two more 4-bit groups of the
    # same FullyConnected, so the plugin's dynamic-quantization kernel runs it. Q4_1: u4 codes with
    # a float zero point -m/d, one plain decompression; measured slower: the CPU plugin runs a
    # float zero point only without dynamic quantization (bench/bench_openvino_int4_weights.py).
    Q4_1_AUGMENTED = "q4_1_g32_aug"
    Q4_1 = "q4_1_g32"
    # Every float weight as f16, by OpenVINO's own compression as the model is saved (saved_f16):
    # the plugin widens them inside its kernels, the arithmetic stays the recipe's.
    F16 = "f16"

    @property
    def saved_f16(self) -> bool:
        """Whether ov.save_model stores the float weights as f16 (compress_to_fp16): only this
        compression's, since halving fp32 weights would break the fp32 artifact's HF parity."""
        return self is WeightCompression.F16

    def apply(self, model: ov.Model) -> dict:
        """Compress `model` in place; returns what was done, for the engine record (F16: done as the
        model is saved, saved_f16)."""
        if self in (WeightCompression.NONE, WeightCompression.F16):
            return {"weights": self.value}
        import nncf

        extra = {}
        if self in Q4_1_FORMS:
            from kiln.compiler.backends.openvino.q4_weights import compress_layer_linears

            extra["q4_1"] = compress_layer_linears(model, Q4_1_FORMS[self])
            # NOTE: NNCF finds no constant weight behind the 4-bit linears now: it compresses only
            # the embedding and the LM head.
            nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT8_SYM)
        elif self is WeightCompression.INT8:
            nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT8_SYM)
        else:
            nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT4_SYM, group_size=32, ratio=1.0)
        return {"weights": self.value, "nncf": nncf.__version__, **extra,
                "constants_by_type": _constant_types(model)}


Q4_1_FORMS = {WeightCompression.Q4_1_AUGMENTED: "augmented", WeightCompression.Q4_1: "zero_point"}


def _constant_types(model: ov.Model) -> dict[str, int]:
    counts: dict[str, int] = {}
    for op in model.get_ordered_ops():
        if op.get_type_name() == "Constant" and op.get_output_size() == 1 and op.shape and len(op.shape) >= 2:
            name = op.get_output_element_type(0).get_type_name()
            counts[name] = counts.get(name, 0) + 1
    return counts
