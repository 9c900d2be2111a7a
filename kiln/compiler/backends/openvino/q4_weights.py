"""4-bit weights with a float minimum per group of 32 (llama.cpp's Q4_1) as OpenVINO compressed weights.

Q4_1 stores each block of 32 weights along K as w = d·q + m, q in 0..15, d and m f16. OpenVINO's
CPU plugin folds a decompression subgraph on a u4 constant into its FullyConnected kernel:

    Constant u4 [N, K/32, 32] ─ Convert f16 ─ Subtract(zp f16 [N, K/32, 1]) ─ Multiply(d f16 [N, K/32, 1])
      ─ Reshape [N, K] ─ Convert f32 ─ MatMul(x, ·, transpose_b)

NNCF writes the zero point as a u4 constant (INT4_ASYM); here it is a float constant, zp = -m/d,
so d·(q - zp) = d·q + m: the Q4_1 weight itself, no second rounding onto an integer zero point.
A Q4_1 source read back from its dequantized fp32 weights gives its blocks again (the block's
minimum is m, its range 15·d: from_weight), so a build from the GGUF runs the GGUF's own 4-bit numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

LEVELS = 15
GROUP_SIZE = 32


@dataclass(frozen=True)
class Q4Blocks:
    """w[n, k] = scales[n, k // g] · codes[n, k] + mins[n, k // g] (an [N, K] weight, groups along K)."""

    codes: np.ndarray       # [N, K] uint8, 0..15
    scales: np.ndarray      # [N, K/g] float16: d
    mins: np.ndarray        # [N, K/g] float16: m

    @property
    def group_size(self) -> int:
        return self.codes.shape[1] // self.scales.shape[1]

    def zero_points(self, dtype=np.float32) -> np.ndarray:
        """[N, K/g]: -m/d, the float zero point (0 where d = 0: the block is m throughout)."""
        d, m = self.scales.astype(np.float32), self.mins.astype(np.float32)
        safe = np.where(d == 0, 1.0, d)
        return np.where(d == 0, 0.0, -m / safe).astype(dtype)

    def dequantize(self) -> np.ndarray:
        """[N, K] float32 by the Q4_1 formula (as gguf dequantizes it: f32(d)·q + f32(m))."""
        g = self.group_size
        d = np.repeat(self.scales.astype(np.float32), g, axis=1)
        m = np.repeat(self.mins.astype(np.float32), g, axis=1)
        return d * self.codes.astype(np.float32) + m

    @classmethod
    def from_weight(cls, w: np.ndarray, group_size: int = GROUP_SIZE) -> "Q4Blocks":
        """Q4_1 blocks of an [N, K] float weight: m = the group's minimum, d = its range / 15 (both
        f16, like llama.cpp's reference quantizer), codes rounded to nearest."""
        w = np.asarray(w, np.float32)
        n, k = w.shape
        if k % group_size:
            raise ValueError(f"K = {k} is no multiple of the group size {group_size}")
        blocks = w.reshape(n, k // group_size, group_size)
        lo, hi = blocks.min(axis=2), blocks.max(axis=2)
        d = ((hi - lo) / LEVELS).astype(np.float16)
        m = lo.astype(np.float16)
        d32 = d.astype(np.float32)[..., None]
        inv = np.where(d32 == 0, 0.0, 1.0 / np.where(d32 == 0, 1.0, d32))
        codes = np.clip(np.rint((blocks - m.astype(np.float32)[..., None]) * inv), 0, LEVELS).astype(np.uint8)
        return cls(codes.reshape(n, k), d, m)


def decompression_subgraph(blocks: Q4Blocks, dtype=np.float16, name: str = "w"):
    """The [N, K] f32 output of the u4 decompression subgraph (dtype: the decompression's float type)."""
    import openvino as ov
    import openvino.opset13 as ops

    n, k = blocks.codes.shape
    g = blocks.group_size
    codes = ops.constant(blocks.codes.reshape(n, k // g, g), dtype=ov.Type.u4, name=f"{name}/q4")
    zp = ops.constant(blocks.zero_points(np.float32).astype(dtype)[..., None], name=f"{name}/zero_point")
    scale = ops.constant(blocks.scales.astype(dtype)[..., None], name=f"{name}/scale")
    x = ops.multiply(ops.subtract(ops.convert(codes, dtype), zp), scale)
    w = ops.reshape(x, ops.constant(np.array([n, k], np.int64)), special_zero=False)
    return ops.convert(w, ov.Type.f32) if dtype != np.float32 else w


def offset_linear(x, blocks: Q4Blocks, offsets: str = "f32", name: str = "w"):
    """x·Wᵀ for the Q4_1 weight W as a symmetric 4-bit FullyConnected plus a block-offset side product:

        d·q + m = d·(q - 8) + c,   c = m + 8·d per block
        x·Wᵀ = FC(x, i4 codes q - 8, scale d) + (x summed over each block of 32) · cᵀ

    The main product has no zero point, so the CPU plugin runs it on its dynamic-quantization
    kernel (int8 activations; a float zero point keeps it off that kernel). offsets: "f32" keeps c
    as is, "i8" stores it 8-bit per output channel (symmetric)."""
    import openvino as ov
    import openvino.opset13 as ops

    n, k = blocks.codes.shape
    g = blocks.group_size
    signed = (blocks.codes.astype(np.int8) - 8).reshape(n, k // g, g)
    codes = ops.constant(signed, dtype=ov.Type.i4, name=f"{name}/i4")
    scale = ops.constant(blocks.scales.astype(np.float16)[..., None], name=f"{name}/scale")
    w = ops.reshape(ops.multiply(ops.convert(codes, ov.Type.f16), scale),
                    ops.constant(np.array([n, k], np.int64)), special_zero=False)
    main = ops.matmul(x, ops.convert(w, ov.Type.f32), transpose_a=False, transpose_b=True)
    c = blocks.scales.astype(np.float32) * 8 + blocks.mins.astype(np.float32)          # [N, K/g]
    rank = (x.output(0) if isinstance(x, ov.Node) else x).get_partial_shape().rank.get_length()
    sums = ops.reduce_sum(ops.reshape(x, ops.constant(np.array([0] * (rank - 1) + [k // g, g], np.int64)),
                                      special_zero=True), ops.constant(np.array([rank], np.int64)), keep_dims=False)
    if offsets == "f32":
        cw = ops.constant(c, name=f"{name}/block_offset")
    else:
        amax = np.abs(c).max(axis=1, keepdims=True)
        cs = np.where(amax == 0, 1.0, amax / 127).astype(np.float16)
        cq = np.clip(np.rint(c / cs.astype(np.float32)), -127, 127).astype(np.int8)
        cw = ops.convert(ops.multiply(ops.convert(ops.constant(cq, name=f"{name}/block_offset_i8"), ov.Type.f16),
                                      ops.constant(cs, name=f"{name}/block_offset_scale")), ov.Type.f32)
    return ops.add(main, ops.matmul(sums, cw, transpose_a=False, transpose_b=True))


LAYER_SCOPE = "/model/layers."          # the exporter's names of the decoder layers' nodes


def layer_linears(model) -> list:
    """The decoder layers' MatMuls on a constant f32 [K, N] weight with K a multiple of GROUP_SIZE
    (the embedding and the LM head are left out: they are not Q4_1 in a GGUF)."""
    found = []
    for op in model.get_ordered_ops():
        if op.get_type_name() != "MatMul" or not op.get_friendly_name().startswith(LAYER_SCOPE):
            continue
        w = op.input_value(1).get_node()
        attrs = op.get_attributes()
        if (w.get_type_name() == "Constant" and w.get_output_element_type(0).get_type_name() == "f32"
                and len(w.shape) == 2 and w.shape[0] % GROUP_SIZE == 0
                and not attrs["transpose_a"] and not attrs["transpose_b"]):
            found.append(op)
    return found


def compress_layer_linears(model, form: str = "zero_point") -> dict:
    """Replace every layer linear's f32 weight by its Q4_1 blocks, in place. form: "zero_point" (u4
    codes, f16 float zero point and scale: one FullyConnected) or "offsets" (offset_linear).
    Returns the record: linears, groups, and how many groups reproduce the source exactly (all of
    them on a Q4_1 source)."""
    import openvino.opset13 as ops

    linears = layer_linears(model)
    groups = exact = 0
    worst = 0.0
    for op in linears:
        name = op.get_friendly_name()
        weight = op.input_value(1).get_node().get_data().T          # [N, K]
        blocks = Q4Blocks.from_weight(weight)
        err = np.abs(blocks.dequantize() - weight).reshape(weight.shape[0], -1, GROUP_SIZE).max(axis=2)
        groups += err.size
        exact += int((err == 0).sum())
        worst = max(worst, float((err / np.maximum(blocks.scales.astype(np.float32), 1e-30)).max()))
        x = op.input_value(0)
        if form == "zero_point":
            y = ops.matmul(x, decompression_subgraph(blocks, np.float16, name), transpose_a=False, transpose_b=True)
        elif form == "offsets":
            y = offset_linear(x, blocks, "f32", name)
        else:
            raise ValueError(f"unknown Q4_1 form {form!r}")
        y.set_friendly_name(name)
        op.output(0).replace(y.output(0))
    return {"linears": len(linears), "groups": groups, "groups_exact": exact,
            "max_error_in_steps": round(worst, 4), "form": form}
