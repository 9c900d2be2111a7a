"""4-bit weights with a float minimum per group of 32 (llama.cpp's Q4_1) as OpenVINO compressed weights.

Q4_1 stores each block of 32 weights along K as w = d·q + m, q in 0..15, d and m f16. OpenVINO's
CPU plugin folds a decompression subgraph on a u4 constant into its FullyConnected kernel:

    Constant u4 [N, K/32, 32] ─ Convert f16 ─ Subtract(zp f16 [N, K/32, 1]) ─ Multiply(d f16 [N, K/32, 1])
      ─ Reshape [N, K] ─ Convert f32 ─ MatMul(x, ·, transpose_b)

NNCF writes the zero point as a u4 constant (INT4_ASYM); here it is a float constant, zp = -m/d,
so d·(q - zp) = d·q + m: the Q4_1 weight itself, no second rounding onto an integer zero point.
A Q4_1 source read back from its dequantized fp32 weights gives its blocks again (the block's
minimum is m, its range 15·d: from_weight), so a build from the GGUF runs the GGUF's own 4-bit
numbers (all 3,317,760 blocks of the SmolLM2 GGUF come back bit-exact).

But the plugin runs a float zero point only on its plain decompression kernel: dynamic
quantization (int8 activations, the fast 4-bit path) takes integer zero points or none. So the
int4 recipe uses augmented_linear instead: codes q - 8 (symmetric, no zero point) and the offsets
m + 8d as two more 4-bit groups of the same FullyConnected, over the input's block sums. Layer by
layer (bench/bench_openvino_int4_weights.py) this form is slower than int4_sym and about level with
the float zero point, but faster than int8; on the whole engine (bench/bench_openvino_int4_engines.py)
it takes less CPU time than the float zero point at one decode, at 8 decodes and for a prefill.
The figures: docs/results/2026-12-06-figures-from-code-comments.md.
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
        w = np.ascontiguousarray(w, np.float32)
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
    # NOTE: contiguous arrays only: openvino takes a strided float16 array for int16.
    codes = ops.constant(np.ascontiguousarray(blocks.codes.reshape(n, k // g, g)), dtype=ov.Type.u4,
                         name=f"{name}/q4")
    zp = ops.constant(np.ascontiguousarray(blocks.zero_points(np.float32).astype(dtype)[..., None]),
                      name=f"{name}/zero_point")
    scale = ops.constant(np.ascontiguousarray(blocks.scales.astype(dtype)[..., None]), name=f"{name}/scale")
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
    signed = np.ascontiguousarray((blocks.codes.astype(np.int8) - 8).reshape(n, k // g, g))
    codes = ops.constant(signed, dtype=ov.Type.i4, name=f"{name}/i4")
    scale = ops.constant(np.ascontiguousarray(blocks.scales.astype(np.float16)[..., None]), name=f"{name}/scale")
    w = ops.reshape(ops.multiply(ops.convert(codes, ov.Type.f16), scale),
                    ops.constant(np.array([n, k], np.int64)), special_zero=False)
    main = ops.matmul(x, ops.convert(w, ov.Type.f32), transpose_a=False, transpose_b=True)
    c = blocks.scales.astype(np.float32) * 8 + blocks.mins.astype(np.float32)          # [N, K/g]
    rank = (x.output(0) if isinstance(x, ov.Node) else x).get_partial_shape().rank.get_length()
    sums = ops.reduce_sum(ops.reshape(x, ops.constant(np.array([0] * (rank - 1) + [k // g, g], np.int64)),
                                      special_zero=True), ops.constant(np.array([rank], np.int64)), keep_dims=False)
    if offsets == "f32":
        cw = ops.constant(np.ascontiguousarray(c), name=f"{name}/block_offset")
    else:
        amax = np.abs(c).max(axis=1, keepdims=True)
        cs = np.where(amax == 0, 1.0, amax / 127).astype(np.float16)
        cq = np.clip(np.rint(c / cs.astype(np.float32)), -127, 127).astype(np.int8)
        cw = ops.convert(ops.multiply(ops.convert(ops.constant(cq, name=f"{name}/block_offset_i8"), ov.Type.f16),
                                      ops.constant(cs, name=f"{name}/block_offset_scale")), ov.Type.f32)
    return ops.add(main, ops.matmul(sums, cw, transpose_a=False, transpose_b=True))


LAYER_SCOPE = "/model/layers."          # the exporter's names of the decoder layers' nodes


LM_HEAD = "/model/lm_head"


def layer_linears(model, lm_head: bool = False) -> list:
    """The decoder layers' MatMuls on a constant f32 [K, N] weight with K a multiple of GROUP_SIZE
    (the LM head too if lm_head; it is no Q4_1 tensor in a GGUF, so its blocks are min/max rounded)."""
    found = []
    for op in model.get_ordered_ops():
        name = op.get_friendly_name()
        if op.get_type_name() != "MatMul" or not (name.startswith(LAYER_SCOPE) or (lm_head and name == LM_HEAD)):
            continue
        w = op.input_value(1).get_node()
        attrs = op.get_attributes()
        if (w.get_type_name() == "Constant" and w.get_output_element_type(0).get_type_name() == "f32"
                and len(w.shape) == 2 and w.shape[0] % GROUP_SIZE == 0
                and not attrs["transpose_a"] and not attrs["transpose_b"]):
            found.append(op)
    return found


def compress_layer_linears(model, form: str = "zero_point", lm_head: bool = False) -> dict:
    """Replace every layer linear's f32 weight by its Q4_1 blocks, in place. form: "zero_point" (u4
    codes, f16 float zero point and scale: one FullyConnected), "offsets" (offset_linear) or
    "augmented" (augmented_linear, 2 digits).
    Returns the record: linears, groups, and how many groups reproduce the source exactly (all of
    them on a Q4_1 source)."""
    import openvino.opset13 as ops

    linears = layer_linears(model, lm_head)
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
        elif form == "augmented":
            y = augmented_linear(x, blocks, 2, name)
        else:
            raise ValueError(f"unknown Q4_1 form {form!r}")
        y.set_friendly_name(name)
        op.output(0).replace(y.output(0))
    return {"linears": len(linears), "groups": groups, "groups_exact": exact,
            "max_error_in_steps": round(worst, 4), "form": form, "lm_head": lm_head}


def augmented_linear(x, blocks: Q4Blocks, digits: int = 2, name: str = "w"):
    """x·Wᵀ for the Q4_1 weight W as ONE symmetric 4-bit FullyConnected over [x, block sums of x]:

        d·q + m = d·(q - 8) + c,   c = m + 8·d per block
        x·Wᵀ = [x, s, ..., s] · [d·(q - 8) | c₁ | ... | c_digits]ᵀ,   s = x summed over each block of 32

    The block sums ride in extra groups of 32 of the same FullyConnected (zero-padded), so the
    plugin's dynamic-quantization kernel runs the whole product in one node. The offsets c are
    4-bit too: digit j holds what digits 1..j-1 left of c (symmetric, one scale per output row
    and group), so each digit divides the offset error by fifteen (two digits: under 1/400 of c's
    range)."""
    import openvino as ov
    import openvino.opset13 as ops

    n, k = blocks.codes.shape
    g = blocks.group_size
    nb = k // g
    pad = -nb % g                                         # zero sums up to a whole group
    c = blocks.scales.astype(np.float32) * 8 + blocks.mins.astype(np.float32)          # [N, K/g]
    c = np.concatenate([c, np.zeros((n, pad), np.float32)], axis=1)                   # [N, P]
    codes, scales = [(blocks.codes.astype(np.int8) - 8).reshape(n, nb, g)], [blocks.scales.astype(np.float32)]
    rest = c
    for _ in range(digits):
        groups = rest.reshape(n, -1, g)
        sc = np.abs(groups).max(axis=2) / 7.0
        sc = sc.astype(np.float16).astype(np.float32)
        q = np.clip(np.rint(groups / np.where(sc == 0, 1.0, sc)[..., None]), -8, 7).astype(np.int8)
        codes.append(q)
        scales.append(sc)
        rest = rest - (q * sc[..., None]).reshape(n, -1)
    all_codes = np.ascontiguousarray(np.concatenate(codes, axis=1))                    # [N, G', g]
    all_scales = np.ascontiguousarray(np.concatenate(scales, axis=1).astype(np.float16)[..., None])
    kk = all_codes.shape[1] * g
    w = ops.reshape(ops.multiply(ops.convert(ops.constant(all_codes, dtype=ov.Type.i4, name=f"{name}/i4"), ov.Type.f16),
                                 ops.constant(all_scales, name=f"{name}/scale")),
                    ops.constant(np.array([n, kk], np.int64)), special_zero=False)
    rank = (x.output(0) if isinstance(x, ov.Node) else x).get_partial_shape().rank.get_length()
    sums = ops.reduce_sum(ops.reshape(x, ops.constant(np.array([0] * (rank - 1) + [nb, g], np.int64)),
                                      special_zero=True), ops.constant(np.array([rank], np.int64)), keep_dims=False)
    if pad:
        sums = ops.pad(sums, np.zeros(rank, np.int64), np.array([0] * (rank - 1) + [pad], np.int64), "constant")
    xa = ops.concat([x, *([sums] * digits)], axis=rank - 1)
    return ops.matmul(xa, ops.convert(w, ov.Type.f32), transpose_a=False, transpose_b=True)
