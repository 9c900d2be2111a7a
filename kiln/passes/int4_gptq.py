"""GPTQ for 4-bit blocks with integer zero points: round one input channel at a time and push its
error onto the channels not yet rounded, weighted by the calibration inputs' E[x xᵀ].

Frantar et al. 2022 (GPTQ), lazy-batch form, groups = MatMulNBits blocks along K; each block's
(scale, zero point) comes from the zero-point search (int4_search.py) over the block's weights as
updated so far. Where the search alone must pick one rounding for a whole block, GPTQ rounds each
weight up or down so that the errors cancel in x·W for inputs like the calibration text's.

    for each batch of 128 channels:                       H⁻¹ = Cholesky(H + λI)⁻¹ (upper)
        for each channel k in it:
            at a block start: (s, z) = search(block of W as updated)
            q_k = round(W_k / s + z);  e = (W_k - s (q_k - z)) / H⁻¹[k, k]
            W[k+1 : batch end] -= H⁻¹[k, k+1 :]ᵀ e
        W[batch end :] -= H⁻¹[batch, after]ᵀ E_batch
"""

from __future__ import annotations

import numpy as np

from kiln.passes.int4_calibration import InputMoments
from kiln.passes.int4_search import LEVELS, BlockQuant, search

BATCH = 128
DAMPING = 0.01       # λ = DAMPING · mean(diag H): the calibration text has fewer tokens than some K


def gptq(w: np.ndarray, block_size: int, moments: InputMoments) -> BlockQuant:
    k, n = w.shape
    if moments.gram is None:
        raise ValueError("GPTQ needs the calibration inputs' E[x xᵀ] (linear_input_moments(gram=True))")
    hinv = _inverse_cholesky(moments.gram)
    weights = np.array(w, np.float64)
    codes = np.zeros((k, n), np.uint8)
    scales = np.zeros((k // block_size, n), np.float32)
    zeros = np.zeros((k // block_size, n), np.uint8)
    batch = max(BATCH // block_size, 1) * block_size
    for b1 in range(0, k, batch):
        b2 = min(b1 + batch, k)
        errors = np.zeros((b2 - b1, n))
        for i in range(b1, b2):
            if i % block_size == 0:
                blk = search(weights[i:i + block_size], block_size, moments.block(i, i + block_size))
                scales[i // block_size], zeros[i // block_size] = blk.scales[0], blk.zero_points[0]
            s, z = scales[i // block_size], zeros[i // block_size].astype(np.float64)
            codes[i] = np.clip(np.round(weights[i] / s + z), 0, LEVELS)
            err = (weights[i] - s * (codes[i] - z)) / hinv[i, i]
            weights[i + 1:b2] -= np.outer(hinv[i, i + 1:b2], err)
            errors[i - b1] = err
        weights[b2:] -= hinv[b1:b2, b2:].T @ errors
    return BlockQuant(codes, scales, zeros)


def _inverse_cholesky(gram: np.ndarray) -> np.ndarray:
    """Upper Cholesky factor of (H + λI)⁻¹; channels never driven get H = 1 (their weight is free)."""
    h = np.array(gram, np.float64)
    dead = np.diag(h) == 0
    h[dead, dead] = 1.0
    h += DAMPING * np.mean(np.diag(h)) * np.eye(len(h))
    return np.linalg.cholesky(np.linalg.inv(h)).T


def gptq_in_blocks(w: np.ndarray, block_size: int, moments: InputMoments) -> BlockQuant:
    """GPTQ whose error feedback stays inside each block, with the search's (scale, zero point):
    H restricted to its diagonal bs x bs blocks, which ~1k calibration tokens estimate well."""
    k, n = w.shape
    nb = k // block_size
    start = search(w, block_size, moments)
    s, z = start.scales[:, None, :], start.zero_points[:, None, :].astype(np.float64)
    grams = np.stack([moments.gram[i:i + block_size, i:i + block_size] for i in range(0, k, block_size)])
    hinv = np.stack([_inverse_cholesky(g) for g in grams])                   # [nb, bs, bs]
    weights = np.array(w, np.float64).reshape(nb, block_size, n)
    codes = np.zeros((nb, block_size, n), np.uint8)
    for i in range(block_size):
        codes[:, i] = np.clip(np.round(weights[:, i] / s[:, 0] + z[:, 0]), 0, LEVELS)
        err = (weights[:, i] - s[:, 0] * (codes[:, i] - z[:, 0])) / hinv[:, i, i, None]
        weights[:, i + 1:] -= hinv[:, i, i + 1:, None] * err[:, None, :]
    return BlockQuant(codes.reshape(k, n), start.scales, start.zero_points)

