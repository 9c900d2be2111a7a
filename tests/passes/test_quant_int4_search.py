"""The integer-zero-point int4 quantizers (int4_search.py) on seeded weights: each is
at least as good as min/max on the error it optimizes, and the bytes are MatMulNBits'."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.compiler.passes.int4_calibration import InputMoments
from kiln.compiler.passes.int4_search import ErrorWeights, matmul_nbits_tensors, min_max, search
from kiln.compiler.passes.quant_tables import weight_quantizer

BS = 32


def calibration_inputs(k: int, seed: int = 0) -> np.ndarray:
    """[tokens, K] inputs with channel scales of very different size and non-zero channel means
    (like RMSNorm outputs with outlier channels)."""
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(400, k)) * rng.gamma(1.0, 1.0, size=k) + rng.normal(0, 0.5, size=k)).astype(np.float32)


def q4_1_weight(k: int, n: int, seed: int = 1) -> np.ndarray:
    """W = d·q + min per block of 32 along K, min a float: the SmolLM2 GGUF's format."""
    rng = np.random.default_rng(seed)
    d = rng.uniform(0.002, 0.01, size=(k // BS, 1, n))
    lo = -rng.uniform(4, 11, size=(k // BS, 1, n)) * d
    q = rng.integers(0, 16, size=(k // BS, BS, n))
    return (q * d + lo).reshape(k, n).astype(np.float32)


def block_errors(w: np.ndarray, quant, weights: ErrorWeights) -> np.ndarray:
    delta = (w - quant.dequantize()).reshape(w.shape[0] // BS, BS, -1)
    return weights.error(delta)


@pytest.mark.parametrize("k,n", [(96, 8), (64, 5), (192, 40)])
def test_min_max_is_onnxruntimes_quantizer_byte_for_byte(k, n):
    w = np.random.default_rng(k).normal(size=(k, n)).astype(np.float32)
    ours = matmul_nbits_tensors(min_max(w, BS))
    theirs = weight_quantizer(4, BS, False).qbits_block_quant(w)
    for a, b in zip(ours, theirs):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("calibrated,gain", [(False, 0.95), (True, 0.8)])
def test_search_never_loses_to_min_max_on_its_weighted_error(calibrated, gain):
    k, n = 192, 64
    w = np.random.default_rng(2).normal(0, 0.05, size=(k, n)).astype(np.float32)
    moments = InputMoments.of(calibration_inputs(k)) if calibrated else None
    weights = ErrorWeights.of(moments, k, BS)
    ours = block_errors(w, search(w, BS, moments), weights)
    base = block_errors(w, min_max(w, BS), weights)
    assert (ours <= base * (1 + 1e-6)).all()             # per block and column: min/max is a candidate
    assert ours.sum() < gain * base.sum()                 # and the search finds better ones


def test_search_beats_the_one_sided_offset_of_min_max_on_a_q4_1_weight():
    """Min/max on Q4_1 keeps s = d and moves the whole block by δ = min + d·z; weighted by inputs
    with non-zero means that error adds up in x·W, and the search avoids it."""
    k, n = 192, 64
    w, x = q4_1_weight(k, n), calibration_inputs(k)
    moments = InputMoments.of(x)

    def output_error(quant) -> float:
        return float(((x @ (w - quant.dequantize())) ** 2).mean())

    assert output_error(search(w, BS, moments)) < 0.5 * output_error(min_max(w, BS))
