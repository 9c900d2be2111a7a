"""A 4-bit linear with a float minimum per block on kiln's own kernel (kiln.MatMulQ4Min).

Each block of 32 weights along K is w = d·q + mn with q in 0..15 and d, mn half floats: llama.cpp's
Q4_1, so a Q4_1 source (the SmolLM2 GGUF) is reproduced exactly, and any other source gets min-max
rounding with an exact offset. MatMulNBits runs this form only on a slow dequantize fallback (its
float zero point) or with a side product (block_offsets.py); the kernel (kiln/engines/ort/native/)
reads it at 4-bit bandwidth: 5 bits a weight with the scale and the minimum.

    MatMul(x, W[K,N] fp32)  ─▶  kiln.MatMulQ4Min(x, B[⌈N/16⌉, K/32, 320] u8)    K, N, accuracy_level=4

B's layout (the kernel's, q4min_kernel.h): per tile of 16 columns and block of 32 rows, 256 bytes of
codes (byte i·64 + j·4 + r holds q[8i+r, j] in its low nibble and q[8i+4+r, j] in its high one),
then the 16 scales and the 16 minimums as float16.

On SmolLM2's decode linears (process CPU time, 1 thread, AVX-512 VNNI path) MatMulQ4Min takes less
time than MatMulNBits 4-bit with integer zero points at one row, at 32 and at 256, and a call's fixed
cost is lower too. SmolLM2 perplexity over fp32 (bench/bench_quant_ppl.py --fuse,
tests/data/perplexity.txt), every linear but the head on MatMulQ4Min: with the head on MatMulQ8 (the
INT4 recipe) it is lowest and below the MatMulNBits recipe it replaces; the head on MatMulQ4Min
costs far more ("L'Étoile" for Paris). The table and the figures:
docs/results/2026-12-06-figures-from-code-comments.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from kiln.compiler.export.external import fill_tensor, tensor_array
from kiln.engines.ort.native import OP_DOMAIN, OP_TYPE, OP_TYPE_Q8

BLOCK = 32
TILE = 16
LEVELS = 15
HALF_MAX = 65504.0


@dataclass(frozen=True)
class Q4MinBlocks:
    """w[k, n] ≈ scales[k // 32, n] · codes[k, n] + mins[k // 32, n]."""

    codes: np.ndarray     # [K, N] uint8, 0..15
    scales: np.ndarray    # [K/32, N] float16
    mins: np.ndarray      # [K/32, N] float16

    def dequantize(self) -> np.ndarray:
        d = np.repeat(self.scales.astype(np.float32), BLOCK, axis=0)
        m = np.repeat(self.mins.astype(np.float32), BLOCK, axis=0)
        return d * self.codes.astype(np.float32) + m


def q4min_blocks(w: np.ndarray) -> Q4MinBlocks:
    """Min-max rounding per block of 32 along K, with the scale and minimum rounded to float16 first
    (so the codes are chosen for the values the kernel reads)."""
    k, n = w.shape
    if k % BLOCK:
        raise ValueError(f"K={k} is not divisible by {BLOCK}")
    blocks = np.asarray(w, np.float32).reshape(k // BLOCK, BLOCK, n)
    lo, hi = blocks.min(axis=1), blocks.max(axis=1)
    mins = lo.astype(np.float16)
    scales = ((hi - mins.astype(np.float32)) / LEVELS).astype(np.float16)
    d = scales.astype(np.float32)[:, None, :]
    safe = np.where(d > 0, d, 1.0)
    codes = np.where(d > 0, np.rint((blocks - mins.astype(np.float32)[:, None, :]) / safe), 0)
    return Q4MinBlocks(np.clip(codes, 0, LEVELS).astype(np.uint8).reshape(k, n), scales, mins)


def pack_tiles(q: Q4MinBlocks) -> np.ndarray:
    """The kernel's B: [⌈N/16⌉, K/32, 320] uint8 (padding columns all zero)."""
    k, n = q.codes.shape
    nb, tiles = k // BLOCK, -(-n // TILE)
    pad = tiles * TILE - n
    codes = np.pad(q.codes, ((0, 0), (0, pad)))
    # [nb, i, lo/hi, r, tiles, j] -> [tiles, nb, i, j, r, lo/hi]
    c = codes.reshape(nb, 4, 2, 4, tiles, TILE).transpose(4, 0, 1, 5, 3, 2)
    packed = (c[..., 0] | (c[..., 1] << 4)).astype(np.uint8).reshape(tiles, nb, 256)

    def halves(a: np.ndarray) -> np.ndarray:
        a = np.pad(a.astype(np.float16), ((0, 0), (0, pad))).reshape(nb, tiles, TILE).transpose(1, 0, 2)
        return np.ascontiguousarray(a).view(np.uint8)           # [tiles, nb, 32]
    return np.ascontiguousarray(np.concatenate([packed, halves(q.scales), halves(q.mins)], axis=2))


def unsupported(w: np.ndarray) -> str | None:
    """Why a weight cannot take this form (None when it can)."""
    if w.shape[0] % BLOCK:
        return f"K={w.shape[0]} is not divisible by {BLOCK}"
    if not np.isfinite(w).all() or np.abs(w).max() > HALF_MAX / 2:
        return "weights outside float16's range"
    return None


def q4min_node(x: str, y: str, b_name: str, k: int, n: int, name: str, accuracy_level: int = 4,
               op_type: str = OP_TYPE) -> onnx.NodeProto:
    """accuracy_level 4: int8 activations (the fast path); 2: int16 (MatMulQ8 only); 0: float activations
    (layout checks)."""
    return helper.make_node(op_type, [x, b_name], [y], name=name, domain=OP_DOMAIN, K=k, N=n,
                            accuracy_level=accuracy_level)


def q4min_linear(graph: onnx.GraphProto, w: TensorProto, node: onnx.NodeProto,
                 weights_dir: Path | None = None) -> onnx.NodeProto:
    """The MatMulQ4Min that replaces MatMul(x, w); its packed weight is appended to `graph`."""
    weight = np.asarray(tensor_array(w, weights_dir), np.float32)
    b_name = f"{w.name}_Q4min"
    graph.initializer.append(fill_tensor(TensorProto(), b_name, pack_tiles(q4min_blocks(weight)), weights_dir))
    k, n = weight.shape
    return q4min_node(node.input[0], node.output[0], b_name, k, n, f"{node.name or w.name}_Q4min")


def ensure_kiln_opset(model: onnx.ModelProto) -> None:
    if not any(o.domain == OP_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(OP_DOMAIN, 1))


# ---- the 8-bit form (kiln.MatMulQ8, llama.cpp's Q8_0): the LM head -----------------------------------
# w = d·q, q in -127..127, d a half float per block of 32: a Q8_0 source (SmolLM2's tied embedding)
# is reproduced exactly. B [⌈N/16⌉, K/32, 544]: 512 bytes of int8 codes (byte g·64 + j·4 + r holds
# q[4g + r, j]), then the 16 scales as float16. Measured on SmolLM2's head, 1 thread: this op takes
# about half the CPU time of 8-bit MatMulNBits a call (docs/results/2026-12-06-figures-from-code-comments.md).

@dataclass(frozen=True)
class Q8Blocks:
    """w[k, n] ≈ scales[k // 32, n] · codes[k, n]."""

    codes: np.ndarray     # [K, N] int8, -127..127
    scales: np.ndarray    # [K/32, N] float16

    def dequantize(self) -> np.ndarray:
        return np.repeat(self.scales.astype(np.float32), BLOCK, axis=0) * self.codes.astype(np.float32)


def q8_blocks(w: np.ndarray) -> Q8Blocks:
    """Symmetric rounding per block of 32 along K, the scale rounded to float16 first."""
    k, n = w.shape
    if k % BLOCK:
        raise ValueError(f"K={k} is not divisible by {BLOCK}")
    blocks = np.asarray(w, np.float32).reshape(k // BLOCK, BLOCK, n)
    scales = (np.abs(blocks).max(axis=1) / 127).astype(np.float16)
    d = scales.astype(np.float32)[:, None, :]
    codes = np.where(d > 0, np.rint(blocks / np.where(d > 0, d, 1.0)), 0)
    return Q8Blocks(np.clip(codes, -127, 127).astype(np.int8).reshape(k, n), scales)


def pack_tiles_q8(q: Q8Blocks) -> np.ndarray:
    """kiln.MatMulQ8's B: [⌈N/16⌉, K/32, 544] uint8 (padding columns all zero)."""
    k, n = q.codes.shape
    nb, tiles = k // BLOCK, -(-n // TILE)
    pad = tiles * TILE - n
    codes = np.pad(q.codes, ((0, 0), (0, pad))).reshape(nb, 8, 4, tiles, TILE).transpose(3, 0, 1, 4, 2)
    codes = np.ascontiguousarray(codes).view(np.uint8).reshape(tiles, nb, 512)
    scales = np.pad(q.scales.astype(np.float16), ((0, 0), (0, pad))).reshape(nb, tiles, TILE).transpose(1, 0, 2)
    return np.ascontiguousarray(np.concatenate([codes, np.ascontiguousarray(scales).view(np.uint8)], axis=2))


def q8_linear(graph: onnx.GraphProto, w: TensorProto, node: onnx.NodeProto,
              weights_dir: Path | None = None, accuracy_level: int = 4) -> onnx.NodeProto:
    """The MatMulQ8 that replaces MatMul(x, w); its packed weight is appended to `graph`."""
    weight = np.asarray(tensor_array(w, weights_dir), np.float32)
    b_name = f"{w.name}_Q8"
    graph.initializer.append(fill_tensor(TensorProto(), b_name, pack_tiles_q8(q8_blocks(weight)), weights_dir))
    k, n = weight.shape
    return q4min_node(node.input[0], node.output[0], b_name, k, n, f"{node.name or w.name}_Q8", accuracy_level,
                      OP_TYPE_Q8)
