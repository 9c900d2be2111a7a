"""Weight compression for the openvino backend, done by NNCF (OpenVINO's compression library).

The CPU plugin runs a compressed weight as a decompression subgraph (u8/i4 constant, convert,
zero point, scale) folded into its matmul kernel. Measured on SmolLM2 (engine-level micro bench,
2 threads, same run; see the module notes in compile.py): NNCF's per-channel int8 beats OpenVINO
reading kiln's own MatMulNBits int8 (blocks of 32) on prefill and decode, so an openvino build
compresses the fp32 graph here instead of taking the quantize pass's output.
"""

from __future__ import annotations

import enum

import openvino as ov


class WeightCompression(enum.Enum):
    NONE = "none"
    # Per output channel, symmetric (no zero point). Against NNCF's default asymmetric int8, SmolLM2,
    # same run (bench/bench_openvino_calls.py, 2 threads): 1 decode 0.98x the time, 8 decodes 0.97x,
    # 32 decodes 0.93-0.96x past 64 tokens and 0.85x past 300, a 512-token prefill 1.00x; perplexity
    # through the engine (bench/kv_pool_perplexity.py, fp32 26.317) 26.715 (+1.51%) against 26.621
    # (+1.16%), the build's check 41.12 against 41.06 (fp32 40.61), top-1 0.920 against 0.928.
    INT8 = "int8_sym"
    INT8_ASYM = "int8_asym"          # NNCF's int8 default; kiln's int8 until 2026-12-01
    INT4 = "int4_sym_g32"            # symmetric, groups of 32 (SmolLM2's 576 is no multiple of 128);
                                     # embedding and LM head stay int8 (NNCF's backup precision)

    def apply(self, model: ov.Model) -> dict:
        """Compress `model` in place; returns what was done, for the engine record."""
        if self is WeightCompression.NONE:
            return {"weights": self.value}
        import nncf

        if self in (WeightCompression.INT8, WeightCompression.INT8_ASYM):
            mode = nncf.CompressWeightsMode(self.value)     # NNCF names its int8 modes by these strings
            nncf.compress_weights(model, mode=mode)
        else:
            nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT4_SYM, group_size=32, ratio=1.0)
        return {"weights": self.value, "nncf": nncf.__version__, "constants_by_type": _constant_types(model)}


def _constant_types(model: ov.Model) -> dict[str, int]:
    counts: dict[str, int] = {}
    for op in model.get_ordered_ops():
        if op.get_type_name() == "Constant" and op.get_output_size() == 1 and op.shape and len(op.shape) >= 2:
            name = op.get_output_element_type(0).get_type_name()
            counts[name] = counts.get(name, 0) + 1
    return counts
