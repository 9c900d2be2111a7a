"""kiln.MatMulQ4Min (Q4_1) and kiln.MatMulQ8 (Q8_0) of kiln's op library (kiln/engines/ort/native/,
its arithmetic in kiln/kernels/) against numpy, through ONNX Runtime, at every instruction-set level
this CPU runs (KILN_MAX_ISA caps the level; the library reads it when a session creates the kernel).

The reference repeats the kernel's scheme in numpy from the unpacked codes, not from the packed bytes,
so a layout error fails it: each row of x quantized per block of 32 to int8 (scale amax/127, the same
float32 rounding), the block sums kept in float, y = Σ_b d·dx·dot(q, xq) + mn·Σx. The integer dots
are exact; what is left is float32 rounding of ~K/32 terms, so the bound is 1e-5 of the terms'
magnitudes — a wrong code, scale, minimum or row is off by orders more.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from kiln.compiler.passes.q4min_linear import (Q4MinBlocks, ensure_kiln_opset, pack_tiles, pack_tiles_q8, q4min_blocks,
                                               q4min_node, q8_blocks)
from kiln.engines.ort import native

ISAS = ("scalar", "avx2", "avx512vnni")     # the levels with micro-kernels of their own (avx512: avx2's)




def model(k: int, n: int, packed: np.ndarray, rank: int = 3, accuracy_level: int = 4, op_type: str = native.OP_TYPE) -> bytes:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [None] * rank)     # the kernel checks K itself
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    b = onnx.numpy_helper.from_array(packed, "b")
    graph = helper.make_graph([q4min_node("x", "y", "b", k, n, "q4", accuracy_level, op_type)], "q4min", [x], [y], [b])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    ensure_kiln_opset(m)
    return m.SerializeToString()


def session(k: int, n: int, packed: np.ndarray, threads: int = 2, rank: int = 3,
            accuracy_level: int = 4, op_type: str = native.OP_TYPE) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    assert native.register(opts)
    return ort.InferenceSession(model(k, n, packed, rank, accuracy_level, op_type), opts,
                                providers=["CPUExecutionProvider"])


def int8_rows(x: np.ndarray):
    """The kernel's activations: (xq [M, nb, 32] int64, dx [M, nb], xs [M, nb]) for x [..., K]."""
    k = x.shape[-1]
    rows = x.reshape(-1, k // 32, 32).astype(np.float32)
    amax = np.abs(rows).max(axis=2, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), np.float32(0)).astype(np.float32)
    xq = np.rint(rows * inv).astype(np.int64)                     # float32 product, rounded half-even
    return xq, (amax / np.float32(127)).astype(np.float64)[..., 0], rows.astype(np.float64).sum(axis=2)


def reference_q8(x: np.ndarray, codes: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    xq, dx, _ = int8_rows(x)
    k = x.shape[-1]
    dot = np.einsum("mbk,bkn->mbn", xq, codes.astype(np.int64).reshape(k // 32, 32, -1)).astype(np.float64)
    terms = dot * scales.astype(np.float64)[None] * dx[..., None]
    return terms.sum(axis=1).reshape(*x.shape[:-1], -1), np.abs(terms).sum(axis=1).reshape(*x.shape[:-1], -1)


def reference(x: np.ndarray, q: Q4MinBlocks) -> tuple[np.ndarray, np.ndarray]:
    """(y, the sum of the terms' magnitudes) in float64 from the kernel's int8 activations."""
    k = x.shape[-1]
    rows = x.reshape(-1, k // 32, 32).astype(np.float32)
    amax = np.abs(rows).max(axis=2, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), np.float32(0)).astype(np.float32)
    xq = np.rint(rows * inv).astype(np.int64)                     # float32 product, rounded half-even
    dx = (amax / np.float32(127)).astype(np.float64)[..., 0]      # [M, nb]
    xs = rows.astype(np.float64).sum(axis=2)                      # [M, nb]
    codes = q.codes.astype(np.int64).reshape(k // 32, 32, -1)     # [nb, 32, N]
    dot = np.einsum("mbk,bkn->mbn", xq, codes).astype(np.float64)
    d, mn = q.scales.astype(np.float64), q.mins.astype(np.float64)
    terms_a = dot * d[None] * dx[..., None]
    terms_b = mn[None] * xs[..., None]
    y = (terms_a + terms_b).sum(axis=1)
    scale = (np.abs(terms_a) + np.abs(terms_b)).sum(axis=1)
    out_shape = (*x.shape[:-1], -1)
    return y.reshape(out_shape), scale.reshape(out_shape)


def runnable(isa: str, monkeypatch) -> None:
    monkeypatch.setenv("KILN_MAX_ISA", isa)
    if native.isa() != isa:
        pytest.skip(f"this CPU does not run the {isa} path (it takes {native.isa()})")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows,k,n", [(1, 32, 16), (1, 576, 960), (1, 96, 40), (3, 64, 33), (5, 160, 17),
                                      (9, 1536, 24), (2, 32, 1)])
def test_matches_numpy(library, isa, rows, k, n, monkeypatch):
    runnable(isa, monkeypatch)
    rng = np.random.default_rng(k * 1000 + n + rows)
    q = q4min_blocks(rng.normal(0, 0.05, (k, n)).astype(np.float32))
    x = rng.normal(0, 1, (1, rows, k)).astype(np.float32)
    x[0, 0, :32] *= 30                                            # an outlier block
    if k >= 64:
        x[0, -1, 32:64] = 0                                       # an all-zero block (scale 0)
    y = session(k, n, pack_tiles(q)).run(None, {"x": x})[0]
    want, scale = reference(x, q)
    assert y.shape == (1, rows, n)
    np.testing.assert_array_less(np.abs(y - want), 1e-5 * scale + 1e-6)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows,k,n", [(1, 32, 16), (1, 576, 200), (3, 64, 33), (6, 160, 17)])
def test_q8_matches_numpy(library, isa, rows, k, n, monkeypatch):
    """kiln.MatMulQ8, codes spanning -127..127 (the AVX-512 path offsets them by 128)."""
    runnable(isa, monkeypatch)
    rng = np.random.default_rng(k + n + rows)
    q = q8_blocks(rng.normal(0, 0.05, (k, n)).astype(np.float32))
    assert q.codes.min() == -127 and q.codes.max() == 127
    x = rng.normal(0, 1, (1, rows, k)).astype(np.float32)
    x[0, 0, :32] *= 30
    y = session(k, n, pack_tiles_q8(q), op_type=native.OP_TYPE_Q8).run(None, {"x": x})[0]
    want, scale = reference_q8(x, q.codes, q.scales)
    assert y.shape == (1, rows, n)
    np.testing.assert_array_less(np.abs(y - want), 1e-5 * scale + 1e-6)
    exact = session(k, n, pack_tiles_q8(q), accuracy_level=0, op_type=native.OP_TYPE_Q8).run(None, {"x": x})[0]
    np.testing.assert_allclose(exact, x @ q.dequantize(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows,k,n", [(2, 64, 40), (7, 96, 16), (13, 160, 50), (32, 64, 17)])
def test_q8_float_activations_are_the_dequantized_product_whatever_rows_share_the_call(library, isa, rows, k, n,
                                                                                    monkeypatch):
    """accuracy_level 0: x · (d·q) in float, and each row's result is bit for bit the one it gets alone
    (one row, two rows and the six-row panel groups add the same products in the same order)."""
    runnable(isa, monkeypatch)
    rng = np.random.default_rng(rows * k + n)
    q = q8_blocks(rng.normal(0, 0.05, (k, n)).astype(np.float32))
    x = rng.normal(0, 1, (rows, k)).astype(np.float32)
    s = session(k, n, pack_tiles_q8(q), rank=2, accuracy_level=0, op_type=native.OP_TYPE_Q8)
    y = s.run(None, {"x": x})[0]
    want = x.astype(np.float64) @ q.dequantize().astype(np.float64)
    bound = np.abs(x).astype(np.float64) @ np.abs(q.dequantize()).astype(np.float64)
    np.testing.assert_array_less(np.abs(y - want), 1e-5 * bound + 1e-7)
    for m in (0, rows // 2, rows - 1):
        np.testing.assert_array_equal(s.run(None, {"x": x[m:m + 1]})[0][0], y[m])
    np.testing.assert_array_equal(s.run(None, {"x": x[:2]})[0], y[:2])


def int16_rows(x: np.ndarray):
    """accuracy_level 2's activations: (xq [M, nb, 32] int64, dx [M, nb]) for x [..., K]."""
    rows = x.reshape(-1, x.shape[-1] // 32, 32).astype(np.float32)
    amax = np.abs(rows).max(axis=2, keepdims=True)
    inv = np.where(amax > 0, np.float32(32767) / np.where(amax > 0, amax, 1), np.float32(0)).astype(np.float32)
    return np.rint(rows * inv).astype(np.int64), (amax / np.float32(32767)).astype(np.float64)[..., 0]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows,k,n", [(1, 32, 16), (1, 576, 200), (2, 96, 33), (3, 64, 40), (5, 160, 17),
                                      (6, 64, 16), (7, 96, 50), (32, 64, 17)])
def test_q8_int16_activations_match_numpy(library, isa, rows, k, n, monkeypatch):
    """accuracy_level 2: each activation block rounded to int16 (scale amax/32767), the block's integer
    dot exact even at full scale (codes at +-127, an outlier block at 32767), one float term per block."""
    runnable(isa, monkeypatch)
    rng = np.random.default_rng(rows * 31 + k + n)
    q = q8_blocks(rng.normal(0, 0.05, (k, n)).astype(np.float32))
    assert q.codes.min() == -127 and q.codes.max() == 127
    x = rng.normal(0, 1, (1, rows, k)).astype(np.float32)
    x[0, 0, :32] = np.sign(x[0, 0, :32]) * 30                    # every code of a block at +-32767
    if k >= 64:
        x[0, -1, 32:64] = 0                                       # an all-zero block (scale 0)
    y = session(k, n, pack_tiles_q8(q), accuracy_level=2, op_type=native.OP_TYPE_Q8).run(None, {"x": x})[0]
    xq, dx = int16_rows(x)
    assert np.abs(xq).max() == 32767
    dot = np.einsum("mbk,bkn->mbn", xq, q.codes.astype(np.int64).reshape(k // 32, 32, -1)).astype(np.float64)
    terms = dot * q.scales.astype(np.float64)[None] * dx[..., None]
    want, scale = terms.sum(axis=1).reshape(1, rows, n), np.abs(terms).sum(axis=1).reshape(1, rows, n)
    assert y.shape == (1, rows, n)
    np.testing.assert_array_less(np.abs(y - want), 1e-5 * scale + 1e-6)
    # and nearer the float product than int8 activations are: 15 bits of each activation, not 7
    x = rng.normal(0, 1, (1, rows, k)).astype(np.float32)
    exact = x @ q.dequantize()
    int16 = session(k, n, pack_tiles_q8(q), accuracy_level=2, op_type=native.OP_TYPE_Q8).run(None, {"x": x})[0]
    int8 = session(k, n, pack_tiles_q8(q), op_type=native.OP_TYPE_Q8).run(None, {"x": x})[0]
    assert np.abs(int16 - exact).max() < np.abs(int8 - exact).max() / 20


@pytest.mark.parametrize("rows,k,n", [(13, 96, 40), (32, 160, 17)])
def test_q8_int16_rows_are_bit_for_bit_the_same_whatever_path_or_neighbours(library, rows, k, n, monkeypatch):
    """accuracy_level 2: two rows widened in registers, three against a widened panel, the scalar
    path: the same exact integer dot and one fused multiply-add per block, so the same bits."""
    rng = np.random.default_rng(rows + k + n)
    q = q8_blocks(rng.normal(0, 0.05, (k, n)).astype(np.float32))
    x = rng.normal(0, 1, (rows, k)).astype(np.float32)
    s = session(k, n, pack_tiles_q8(q), rank=2, accuracy_level=2, op_type=native.OP_TYPE_Q8)
    y = s.run(None, {"x": x})[0]
    for m in (0, rows // 2, rows - 1):
        np.testing.assert_array_equal(s.run(None, {"x": x[m:m + 1]})[0][0], y[m])
    for few in (2, 3, 5, 7):
        np.testing.assert_array_equal(s.run(None, {"x": x[:few]})[0], y[:few])
    monkeypatch.setenv("KILN_MAX_ISA", "scalar")
    scalar = session(k, n, pack_tiles_q8(q), rank=2, accuracy_level=2, op_type=native.OP_TYPE_Q8)
    np.testing.assert_array_equal(scalar.run(None, {"x": x})[0], y)


def test_q8_0_weights_are_reproduced_exactly():
    rng = np.random.default_rng(5)
    codes = rng.integers(-127, 128, (64, 24)).astype(np.int8)
    codes[0], codes[32] = 127, -127
    d = rng.uniform(1e-3, 1e-2, (2, 24)).astype(np.float16)
    from kiln.compiler.passes.q4min_linear import Q8Blocks
    q = q8_blocks(Q8Blocks(codes, d).dequantize())
    np.testing.assert_array_equal(q.codes, codes)
    np.testing.assert_array_equal(q.scales, d)


@pytest.mark.parametrize("isa", ISAS)
def test_paths_agree_with_float_matmul_and_threads(library, isa, monkeypatch):
    """The int8 activations stay close to the float product, and one thread gives the same as two."""
    runnable(isa, monkeypatch)
    rng = np.random.default_rng(7)
    w = rng.normal(0, 0.05, (256, 80)).astype(np.float32)
    q = q4min_blocks(w)
    x = rng.normal(0, 1, (4, 256)).astype(np.float32)
    packed = pack_tiles(q)
    y2 = session(256, 80, packed, threads=2, rank=2).run(None, {"x": x})[0]
    y1 = session(256, 80, packed, threads=1, rank=2).run(None, {"x": x})[0]
    np.testing.assert_array_equal(y1, y2)
    exact = x @ q.dequantize()
    assert np.abs(y2 - exact).max() < 0.02 * np.abs(exact).max()


@pytest.mark.parametrize("rows,k,n", [(1, 64, 16), (5, 96, 37)])
def test_float_activations_match_the_dequantized_product(library, rows, k, n):
    """accuracy_level 0 (the build's layout checks): x · (d·q + mn) with float activations."""
    rng = np.random.default_rng(11)
    q = q4min_blocks(rng.normal(0, 0.05, (k, n)).astype(np.float32))
    x = rng.normal(0, 1, (rows, k)).astype(np.float32)
    y = session(k, n, pack_tiles(q), rank=2, accuracy_level=0).run(None, {"x": x})[0]
    want = x.astype(np.float64) @ q.dequantize().astype(np.float64)
    bound = np.abs(x).astype(np.float64) @ np.abs(q.dequantize()).astype(np.float64)
    np.testing.assert_array_less(np.abs(y - want), 1e-5 * bound + 1e-7)


def test_q4_1_weights_are_reproduced_exactly():
    """A Q4_1 block (w = d·q + m with half-float d and m) comes back with the same codes, d and m."""
    rng = np.random.default_rng(3)
    codes = rng.integers(0, 16, (64, 24)).astype(np.uint8)
    codes[0], codes[31], codes[32], codes[63] = 0, 15, 0, 15       # each block spans 0..15
    d = rng.uniform(1e-3, 1e-2, (2, 24)).astype(np.float16)
    m = rng.uniform(-0.1, 0.0, (2, 24)).astype(np.float16)
    w = Q4MinBlocks(codes, d, m).dequantize()
    q = q4min_blocks(w)
    np.testing.assert_array_equal(q.codes, codes)
    np.testing.assert_array_equal(q.scales, d)
    np.testing.assert_array_equal(q.mins, m)


def test_wrong_shapes_are_refused(library):
    q = q4min_blocks(np.ones((64, 16), np.float32))
    sess = session(64, 16, pack_tiles(q))
    with pytest.raises(Exception, match="last dimension must be K=64"):
        sess.run(None, {"x": np.ones((1, 1, 32), np.float32)})
    bad = session(64, 32, pack_tiles(q))                           # B packed for N=16, attribute says 32
    with pytest.raises(Exception, match=r"B must be \[2, 2, 320\]"):
        bad.run(None, {"x": np.ones((1, 1, 64), np.float32)})


def test_int16_activations_are_matmulq8s_alone(library):
    q = q4min_blocks(np.ones((32, 16), np.float32))
    with pytest.raises(Exception, match=r"accuracy_level must be 0 \(float activations\) or 4"):
        session(32, 16, pack_tiles(q), accuracy_level=2)


def test_empty_batch(library):
    q = q4min_blocks(np.ones((32, 16), np.float32))
    y = session(32, 16, pack_tiles(q)).run(None, {"x": np.zeros((0, 3, 32), np.float32)})[0]
    assert y.shape == (0, 3, 16)


def test_without_a_compiler_the_build_says_int4_keeps_matmulnbits(monkeypatch):
    """No C++ compiler on the machine: no library, and the message says what int4 builds fall back to."""
    from kiln.engines.ort.native import build as native_build
    from kiln.kernels import build as kernels_build

    monkeypatch.setattr(kernels_build.shutil, "which", lambda name: None)
    monkeypatch.setattr(kernels_build.OpLibrary, "up_to_date", lambda self: False)
    library, message = native_build.build()
    assert library is None and "no C++ compiler" in message and "MatMulNBits" in message


def test_the_library_builds_from_its_own_sources_alone(library, tmp_path, monkeypatch):
    """No compile is given an include folder outside kiln's own sources, and no onnxruntime headers:
    everything it declares of ONNX Runtime's ABI is in the library's own files."""
    import dataclasses

    from kiln.engines.ort.native import build as native_build
    from kiln.kernels import build as kernels_build

    ort_library = kernels_build.ort_library
    monkeypatch.setattr(kernels_build, "ort_library",
                        lambda: dataclasses.replace(ort_library(), library=tmp_path / "ort" / "lib.so"))
    monkeypatch.setattr(kernels_build, "OUT_DIR", tmp_path / "kernels")
    seen = []
    real_run = kernels_build.subprocess.run
    monkeypatch.setattr(kernels_build.subprocess, "run", lambda cmd, **kw: seen.append(cmd) or real_run(cmd, **kw))
    library, message = native_build.build(force=True)
    assert library == tmp_path / "ort" / "lib.so" and library.stat().st_size > 0, message
    compiles = [cmd for cmd in seen if "-c" in cmd]
    assert len(compiles) == len(kernels_build.kernel_units()) + 2
    includes = {arg[2:] for cmd in compiles for arg in cmd if arg.startswith("-I")}
    assert includes == {str(kernels_build.KERNELS)}
