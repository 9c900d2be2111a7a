"""Every tensor type published GGUFs use is read, through gguf.quants.dequantize.

Types gguf-py can quantize are written with it; K-quant blocks (which it cannot write) are laid out
by hand, with known values, from ggml's dequantize_row_q4_K / _q6_K, and as random valid blocks.
The whole-model check (a K-quant Llama built and run) is in test_gguf_architectures.py.
"""

from __future__ import annotations

import numpy as np
import pytest

import gguf
from gguf import GGMLQuantizationType as Q
from bench.gguf_models import write_gguf_file
from gguf_writing import K_SCALES, kquant_blocks, write_gguf
from kiln.compiler.export.gguf_reader import GGUFError, GGUFFile
from kiln.compiler.export.sources import load_source

ROWS, COLS = 3, 512
# worst error of a round trip, relative to the largest |value|: what each type's precision allows
ROUND_TRIP = {Q.F32: 0, Q.F16: 1e-3, Q.BF16: 1e-2, Q.Q8_0: 1e-2, Q.Q5_0: 0.05, Q.Q5_1: 0.05,
              Q.Q4_0: 0.1, Q.Q4_1: 0.1}


def write_one(path, raw: np.ndarray, qtype: Q) -> GGUFFile:
    return GGUFFile(write_gguf_file(path, "llama", {}, [("t.weight", raw, qtype)]))


@pytest.mark.parametrize("qtype", sorted(ROUND_TRIP, key=int), ids=lambda t: t.name)
def test_types_gguf_writes_read_back(tmp_path, qtype):
    x = np.random.default_rng(0).normal(size=(ROWS, COLS)).astype(np.float32)
    stored = gguf.quants.quantize(x, qtype)
    got = write_one(tmp_path / "t.gguf", stored, qtype).read("t.weight")
    assert got.dtype == np.float32 and got.shape == (ROWS, COLS)
    assert np.array_equal(got, gguf.quants.dequantize(stored, qtype).reshape(ROWS, COLS))
    assert float(np.abs(got - x).max()) <= ROUND_TRIP[qtype] * float(np.abs(x).max())


@pytest.mark.parametrize("qtype", sorted(K_SCALES, key=int), ids=lambda t: t.name)
def test_k_quant_blocks_read_back(tmp_path, qtype):
    blocks = kquant_blocks((ROWS, COLS), qtype, np.random.default_rng(1), 1.0)
    got = write_one(tmp_path / "t.gguf", blocks, qtype).read("t.weight")
    assert got.shape == (ROWS, COLS) and np.isfinite(got).all()
    assert np.array_equal(got, gguf.quants.dequantize(blocks, qtype).reshape(ROWS, COLS))


def f16(x: float) -> list[int]:
    return list(np.float16(x).tobytes())


def q4_k_block() -> tuple[np.ndarray, np.ndarray]:
    """One Q4_K block, and its 256 values by ggml's rule: 8 sub-blocks of 32, value = d·sc·q − dmin·m,
    sub-block pairs sharing 32 bytes of qs (low nibbles, then high)."""
    d, dmin, sc, m = 0.5, 0.25, list(range(1, 9)), list(range(8))     # all < 16: no high scale bits
    scales = sc[:4] + m[:4] + [sc[j] | m[j] << 4 for j in range(4, 8)]
    q = np.arange(256) % 16
    qs = [q[c * 64 + k] | q[c * 64 + 32 + k] << 4 for c in range(4) for k in range(32)]
    sub = np.arange(256) // 32
    values = d * np.array(sc)[sub] * q - dmin * np.array(m)[sub]
    return np.array(f16(d) + f16(dmin) + scales + qs, np.uint8), values


def q6_k_block() -> tuple[np.ndarray, np.ndarray]:
    """One Q6_K block: 16 int8 scales of 16 values each; 6-bit q from ql's nibbles and qh's bit pairs, minus 32."""
    d, sc = 0.125, list(range(1, 17))
    ql, qh = [0x31] * 128, [0b11100100] * 64      # per 32-value quarter of each 128: q = -31, -15, 3, 19
    quarter = [-31, -15, 3, 19]
    e = np.arange(256)
    values = d * np.array(sc)[e // 16] * np.array(quarter)[(e % 128) // 32]
    return np.array(ql + qh + list(np.array(sc, np.int8).view(np.uint8)) + f16(d), np.uint8), values


def q8_0_block() -> tuple[np.ndarray, np.ndarray]:
    q = np.arange(-16, 16, dtype=np.int8)
    return np.array(f16(0.5) + list(q.view(np.uint8)), np.uint8), 0.5 * q


@pytest.mark.parametrize("block,qtype", [(q4_k_block, Q.Q4_K), (q6_k_block, Q.Q6_K), (q8_0_block, Q.Q8_0)],
                         ids=["Q4_K", "Q6_K", "Q8_0"])
def test_hand_built_block_has_ggml_values(tmp_path, block, qtype):
    raw, values = block()
    assert raw.size == gguf.GGML_QUANT_SIZES[qtype][1]
    got = write_one(tmp_path / "t.gguf", raw[None], qtype).read("t.weight")
    np.testing.assert_array_equal(got[0], values.astype(np.float32))


def test_type_without_a_dequantizer_is_refused_by_name(tmp_path):
    """Q8_K is llama.cpp's activation format for its dot products, never a published weight type;
    gguf-py has no dequantizer for it, so it is refused before anything is read."""
    written = write_gguf("llama-kquants", tmp_path, quants=[("down_proj", Q.Q8_K)])
    with pytest.raises(GGUFError, match=r"blk\.0\.ffn_down\.weight is stored as Q8_K.*cannot dequantize"):
        load_source(str(written.path))
