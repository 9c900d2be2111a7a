"""4-bit blocks with an integer zero point, chosen by a search instead of min/max.

MatMulNBits runs fast only with an integer (4-bit) zero point: w ≈ s·(q - z), q and z in 0..15.
Min/max rounding (onnxruntime's quantizer) takes s = (max - min)/15 and z = round(-min/s). On a
Q4_1 source (w = d·k + m on every block: the SmolLM2 GGUF) that is s = d and the whole block is
off by the same δ = m + d·z, |δ| <= d/2: an error of one sign that adds up in the dot product.

The search tries several scales per block (llama.cpp make_qkx-style: the block's range spread over
15 ± a few steps), both neighbouring zero points, and for each a weighted least-squares refit of
s for the chosen codes, and keeps the candidate of least weighted error

    err(Δ) = Σ_k v_k·Δ_k² + (Σ_k μ_k·Δ_k)²          Δ = w - s·(q - z) over one block

with v = Var[x] and μ = E[x] of the input channels (int4_calibration.py): E[(x·Δ)²] with the
centred channels taken as independent. Without moments v = 1 and μ = 0: plain squared error.
Min/max's own (s, z) is one of the candidates, so the search never does worse on err.

Why the recipe is what it is (the measured splits, perplexity and speed, with their commands:
docs/results/2026-11-29-the-int4-recipe.md): on SmolLM2's Q4_1 source, all linears 4-bit with the
searched integer zero point cost too much perplexity and fail the build's logit check; the calibrated
search beats min/max and plain squared error by a wide margin; GPTQ and AWQ scaling did not help and
were dropped. The error left is the second rounding of an already 4-bit weight onto a grid that
cannot hold its float minimum, so the INT4 recipe keeps the MLP (gate_up, down) at 8 bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kiln.compiler.passes.int4_calibration import InputMoments

LEVELS = 15                       # 4 bits: codes 0..15
SPREADS = np.linspace(-1.0, 1.0, 9)   # extra steps the block's range spans: 15 - 1 .. 15 + 1


@dataclass(frozen=True)
class BlockQuant:
    """w[k, n] ≈ scales[k // bs, n] · (codes[k, n] - zero_points[k // bs, n])."""

    codes: np.ndarray           # [K, N] uint8
    scales: np.ndarray          # [K/bs, N] float32
    zero_points: np.ndarray     # [K/bs, N] uint8

    def dequantize(self) -> np.ndarray:
        bs = self.codes.shape[0] // self.scales.shape[0]
        s = np.repeat(self.scales, bs, axis=0)
        return s * (self.codes.astype(np.float32) - np.repeat(self.zero_points, bs, axis=0))


@dataclass(frozen=True)
class ErrorWeights:
    """The search's error weights over one block: v [nb, bs, 1] and μ [nb, bs, 1]."""

    variance: np.ndarray
    mean: np.ndarray

    @classmethod
    def of(cls, moments: InputMoments | None, k: int, block_size: int) -> ErrorWeights:
        if moments is None:
            return cls(np.ones((k // block_size, block_size, 1), np.float32),
                       np.zeros((k // block_size, block_size, 1), np.float32))
        variance = np.maximum(moments.square - moments.mean ** 2, 0.0)
        shape = (k // block_size, block_size, 1)
        return cls(variance.astype(np.float32).reshape(shape), moments.mean.astype(np.float32).reshape(shape))

    def error(self, delta: np.ndarray) -> np.ndarray:
        """[nb, N] weighted error of delta [nb, bs, N]."""
        return (self.variance * delta * delta).sum(axis=1) + (self.mean * delta).sum(axis=1) ** 2


def min_max(w: np.ndarray, block_size: int) -> BlockQuant:
    """onnxruntime's round-to-nearest min/max (the range always includes 0)."""
    blocks = _blocks(w, block_size)
    lo, hi = np.minimum(blocks.min(axis=1), 0), np.maximum(blocks.max(axis=1), 0)
    scale = _safe((hi - lo) / LEVELS)
    zero = np.clip(np.round(-lo / scale), 0, LEVELS)
    return _pack(blocks, scale, zero)


def search(w: np.ndarray, block_size: int, moments: InputMoments | None = None) -> BlockQuant:
    """The (scale, zero point) per block of least weighted error among the candidates above."""
    blocks = _blocks(w, block_size)
    weights = ErrorWeights.of(moments, w.shape[0], block_size)
    start = min_max(w, block_size)
    best_s, best_z = start.scales.copy(), start.zero_points.astype(np.float32)
    best = weights.error(blocks - _dequant(blocks, best_s, best_z))
    lo, hi = blocks.min(axis=1), blocks.max(axis=1)
    for spread in SPREADS:
        scale = _safe((hi - lo) / (LEVELS + spread))
        for zero in _zero_candidates(lo, scale):
            s, z = _refit(blocks, scale, zero, weights), zero
            err = weights.error(blocks - _dequant(blocks, s, z))
            better = err < best
            best = np.where(better, err, best)
            best_s, best_z = np.where(better, s, best_s), np.where(better, z, best_z)
    return _pack(blocks, best_s, best_z)


def _zero_candidates(lo: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The integer zero points on either side of the one that puts the block minimum on code 0."""
    exact = -lo / scale
    return np.clip(np.floor(exact), 0, LEVELS), np.clip(np.ceil(exact), 0, LEVELS)


def _refit(blocks: np.ndarray, scale: np.ndarray, zero: np.ndarray, weights: ErrorWeights) -> np.ndarray:
    """Given the codes that (scale, zero) round to, the scale minimising the weighted error:
    d err / d s = 0 for Δ = w - s·c, c = q - z."""
    c = _codes(blocks, scale, zero) - zero[:, None, :]
    num = (weights.variance * blocks * c).sum(axis=1) + (weights.mean * blocks).sum(axis=1) * (weights.mean * c).sum(axis=1)
    den = (weights.variance * c * c).sum(axis=1) + (weights.mean * c).sum(axis=1) ** 2
    refit = np.where(den > 0, num / np.where(den > 0, den, 1), scale)
    return np.where(refit > 0, refit, scale).astype(np.float32)


def _codes(blocks: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> np.ndarray:
    return np.clip(np.round(blocks / scale[:, None, :] + zero[:, None, :]), 0, LEVELS)


def _dequant(blocks: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> np.ndarray:
    return scale[:, None, :] * (_codes(blocks, scale, zero) - zero[:, None, :])


def _pack(blocks: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> BlockQuant:
    codes = _codes(blocks, scale, zero).astype(np.uint8)
    return BlockQuant(codes.reshape(-1, codes.shape[-1]), scale.astype(np.float32), zero.astype(np.uint8))


def _blocks(w: np.ndarray, block_size: int) -> np.ndarray:
    k, n = w.shape
    if k % block_size:
        raise ValueError(f"K={k} is not divisible by block_size={block_size}")
    return np.asarray(w, np.float32).reshape(k // block_size, block_size, n)


def _safe(scale: np.ndarray) -> np.ndarray:
    """A block of equal weights has range 0: any positive scale represents it (with its zero point)."""
    return np.where(scale > 0, scale, 1.0).astype(np.float32)


def matmul_nbits_tensors(q: BlockQuant) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """MatMulNBits' 4-bit B [N, K/bs, bs/2], scales [N, K/bs] and packed zero points
    [N, ceil(K/bs / 2)]: two codes a byte, the first in the low nibble (an odd count of blocks
    pads with 8, as onnxruntime's quantizer does, so equal inputs give equal bytes)."""
    nb, n = q.scales.shape
    codes = q.codes.T.reshape(n, nb, -1)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    zp = q.zero_points.T
    if nb % 2:
        zp = np.concatenate([zp, np.full((n, 1), 8, np.uint8)], axis=1)
    return packed, np.ascontiguousarray(q.scales.T), (zp[:, 0::2] | (zp[:, 1::2] << 4)).astype(np.uint8)
