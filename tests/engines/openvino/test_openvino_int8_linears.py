"""kiln's int8 linears on the openvino backend: packing, the kernel against numpy, the operations in an
OpenVINO graph, an engine built on them against the dense graph, and what a load does without them."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

ov = pytest.importorskip("openvino")

from kiln.compiler.backends.openvino.int8_linears import (GateUpI8, LinearI8, pack_codes,  # noqa: E402
                                                         quantize_weight, smoothing)
from kiln.engines.openvino import native  # noqa: E402

needs_kernel = pytest.mark.skipif(not native.usable(), reason="kiln's OpenVINO op library is not built, or this CPU "
                                  "lacks AVX-512 VNNI")


def reference(x: np.ndarray, weight: np.ndarray, sm: np.ndarray | None = None) -> np.ndarray:
    """What the kernel computes, in numpy: each row of x * sm rounded to int8 with one scale, times
    the weight's int8 codes per output channel, summed exactly."""
    xs = (x * (1 if sm is None else sm)).astype(np.float64)
    scale = np.abs(weight).max(axis=1) / 127.0
    codes = np.clip(np.rint(weight / scale[:, None]), -127, 127)
    s = np.abs(xs).max(axis=1) / 127.0
    s[s == 0] = 1.0
    return (np.rint(xs / s[:, None]) @ codes.T) * s[:, None] * scale[None]


def run_kernel(x: np.ndarray, weight: np.ndarray, sm: np.ndarray) -> np.ndarray:
    codes, scale, comp = quantize_weight(weight)
    m, k = x.shape
    y = np.empty((m, weight.shape[0]), np.float32)
    fn = ctypes.CDLL(str(native.require())).kiln_ov_linear_i8
    p, n = ctypes.c_void_p, ctypes.c_size_t
    fn.argtypes = [p, p, n, n, p, p, p, n, p]
    sm = np.ascontiguousarray(sm, np.float32)
    fn(x.ctypes.data, sm.ctypes.data, m, k, codes.ctypes.data, scale.ctypes.data, comp.ctypes.data, weight.shape[0],
       y.ctypes.data)
    return y


def test_packing_puts_16_columns_of_4_codes_in_each_vector():
    codes = np.arange(32 * 8, dtype=np.int64).reshape(32, 8).astype(np.int8)
    packed = pack_codes(codes).reshape(2, 2, 16, 4)              # [N/16][K/4][16][4]
    assert packed[1, 0, 3, 2] == codes[16 + 3, 2] and packed[0, 1, 15, 0] == codes[15, 4]
    _, scale, comp = quantize_weight(np.ones((16, 130), np.float32))
    assert comp.shape == (16,) and np.all(comp == 128 * 130 * 127)
    assert np.allclose(scale, 1 / 127)


@needs_kernel
@pytest.mark.parametrize("m, k, n", [(1, 576, 960), (7, 1536, 576), (32, 130, 48), (70, 256, 64), (9, 64, 16 * 7)])
def test_kernel_matches_numpy(m, k, n):
    """Ragged K (130: padding), rows past the few-rows path (70), one row, a ragged last column tile
    (7 vectors of 16), each channel scaled by its own factor before quantization."""
    rng = np.random.default_rng(m * k)
    weight = rng.standard_normal((n, k)).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    sm = rng.uniform(0.5, 2.0, k).astype(np.float32)
    want = reference(x, weight, sm)
    assert np.abs(run_kernel(x, weight, sm) - want).max() < 1e-4 * np.abs(want).max()


@needs_kernel
def test_smoothing_moves_an_outlier_channel_into_the_weights():
    """One channel 100x the others sets a row's one scale and rounds the rest to a few codes; with
    SmoothQuant's factors (x / s, W * s) the product is far closer to the float one."""
    rng = np.random.default_rng(3)
    k, n = 256, 64
    weight = rng.standard_normal((n, k)).astype(np.float32)
    x = rng.standard_normal((16, k)).astype(np.float32)
    x[:, 5] *= 100
    exact = x.astype(np.float64) @ weight.T
    plain = np.abs(run_kernel(x, weight, np.ones(k)) - exact).max()
    s = smoothing(np.abs(x).max(axis=0), [weight])
    smoothed = np.abs(run_kernel(x, weight * s[None, :], 1 / s) - exact).max()
    assert s[5] > 5 * np.median(s)
    assert smoothed < plain / 3


@needs_kernel
def test_gate_up_operation_in_an_openvino_graph(tmp_path):
    """The saved graph carries kiln's operation types; a Core with the library runs them."""
    rng = np.random.default_rng(1)
    k, n = 192, 96
    gate, up = (rng.standard_normal((n, k)).astype(np.float32) for _ in range(2))
    down = rng.standard_normal((64, n)).astype(np.float32)
    x = ov.opset13.parameter([-1, -1, k], ov.Type.f32, name="x")
    sm = rng.uniform(0.5, 2.0, k).astype(np.float32)
    consts = [ov.opset13.constant(a).output(0) for w in (gate, up) for a in quantize_weight(w)]
    node = GateUpI8([x.output(0), *consts, ov.opset13.constant(sm).output(0)])
    lin = LinearI8([node.output(0), *(ov.opset13.constant(a).output(0) for a in quantize_weight(down)),
                    ov.opset13.constant(np.ones(n, np.float32)).output(0)])
    # NOTE: no fp16 compression: comp (128 x a column's sum of codes) exceeds f16's range.
    ov.save_model(ov.Model([lin.output(0)], [x]), tmp_path / "m.xml", compress_to_fp16=False)
    core = ov.Core()
    core.add_extension(str(native.require()))
    compiled = core.compile_model(core.read_model(tmp_path / "m.xml"), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    xv = rng.standard_normal((2, 5, k)).astype(np.float32)
    got = compiled(xv)[0].reshape(10, -1)
    g, u = reference(xv.reshape(10, k), gate, sm), reference(xv.reshape(10, k), up, sm)
    hidden = (g / (1 + np.exp(-g)) * u).astype(np.float32)
    want = reference(hidden, down)
    assert got.shape == (10, 64)
    assert np.abs(got - want).max() < 1e-3 * np.abs(want).max()


@needs_kernel
def test_engine_on_kiln_linears_stays_close_to_fp32(tmp_path):
    """tiny-llama built as the int8 recipe builds on such a CPU: every layer linear is kiln's, and the
    paged engine (chunked, ragged steps) stays near the dense fp32 graph."""
    from kiln.compiler.backends.openvino.compile import compile_openvino
    from kiln.compiler.backends.openvino.recipe import KILN_INT8
    from kiln.contract.engine import BucketGrid, KvLayout
    from kiln.engines.openvino.loader import open_openvino
    from openvino_testing import standard_graph
    from test_openvino_engine import DenseReference, Sequences

    spec, model = standard_graph("tiny-llama")
    calibration = np.random.default_rng(2).integers(0, spec.vocab_size, 64).tolist()
    record = compile_openvino(model, spec, tmp_path / "engines" / "openvino", KILN_INT8, root=tmp_path,
                              calibration_ids=calibration)[0]
    assert record["options"]["kernels"] == native.KERNELS
    assert record["compression"]["kernels"] == {"name": native.KERNELS, "gated_pairs": spec.num_layers,
                                                "linears": 3 * spec.num_layers,         # qkv, o, down
                                                "smoothing": 0.5, "calibration_tokens": 64}
    assert "compiled" in record                                    # the blob imports with kiln's operations
    engine = open_openvino(tmp_path, record, spec, BucketGrid(), KvLayout(**record["kv_layout"]), threads=2)
    assert engine.loaded_from == "blob"
    engine.allocate_kv(64)
    reference_logits = DenseReference(spec, model)
    rng = np.random.default_rng(4)
    seqs = Sequences([rng.integers(0, spec.vocab_size, n).tolist() for n in (20, 50)], engine.block_size, 64, seed=6)
    for chunk in ({0: 12, 1: 40}, {0: 8, 1: 10}):
        starts = {b: seqs.done[b] for b in chunk}
        got = engine.execute(seqs.batch(chunk)).logits
        want = np.concatenate([reference_logits(seqs.tokens[b][:starts[b] + n])[starts[b]:] for b, n in chunk.items()])
        assert np.abs(got - want).max() < 0.1 * np.abs(want).max()


LEVEL_RUN = """
import ctypes, sys, numpy as np
from kiln.compiler.backends.openvino.int8_linears import quantize_weight
from kiln.engines.openvino import native
lib = ctypes.CDLL(str(native.require()))
p, n_ = ctypes.c_void_p, ctypes.c_size_t
lib.kiln_ov_linear_i8.argtypes = [p, p, n_, n_, p, p, p, n_, p]
lib.kiln_ov_gate_up_i8.argtypes = [p, p, n_, n_, p, p, p, p, p, p, n_, p]
out = [np.array(native.linear_level())]
for m, k, n in %r:
    rng = np.random.default_rng(m * k + n)
    x, sm = rng.standard_normal((m, k)).astype(np.float32), rng.uniform(0.5, 2.0, k).astype(np.float32)
    packed = [a for w in rng.standard_normal((2, n, k)).astype(np.float32) for a in quantize_weight(w)]
    at = [a.ctypes.data for a in packed]
    y, yg = np.empty((m, n), np.float32), np.empty((m, n), np.float32)
    lib.kiln_ov_linear_i8(x.ctypes.data, sm.ctypes.data, m, k, *at[:3], n, y.ctypes.data)
    lib.kiln_ov_gate_up_i8(x.ctypes.data, sm.ctypes.data, m, k, *at, n, yg.ctypes.data)
    out += [y, yg]
np.savez(sys.argv[1], *out)
"""


def run_level(tmp_path, shapes, max_isa: str | None) -> list[np.ndarray]:
    """The level the linears ran on, then each shape's linear and gate-up outputs, computed in a fresh
    process at the level KILN_MAX_ISA caps."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "KILN_MAX_ISA"}
    if max_isa:
        env["KILN_MAX_ISA"] = max_isa
    out = tmp_path / f"{max_isa or 'host'}.npz"
    subprocess.run([sys.executable, "-c", LEVEL_RUN % (shapes,), str(out)], env=env, check=True)
    with np.load(out) as arrays:
        return [arrays[f"arr_{i}"] for i in range(len(arrays.files))]


@pytest.mark.skipif(not (native.usable() and native.kernel_instructions() == "AMX int8 tiles"),
                    reason="this CPU has no AMX tiles (the amx level's kernels run only there)")
def test_amx_tiles_give_the_vnni_levels_outputs_bit_for_bit(tmp_path):
    """Both levels sum the same int8 products exactly in int32 and scale them alike, so their outputs are
    equal bit for bit: rows below the tiles' threshold (1), one partial tile (5), one whole (16), past it
    (17, 32: two tiles; 70: three calls), K in whole tiles of 64 (576) and not (130, 600), one and two
    weight tiles per call (n = 48: three tiles, the last alone)."""
    shapes = [(1, 576, 64), (5, 130, 48), (16, 576, 96), (17, 600, 48), (32, 576, 1536), (70, 1536, 64)]
    (amx_level, *amx), (vnni_level, *vnni) = run_level(tmp_path, shapes, None), run_level(tmp_path, shapes, "avx512vnni")
    assert (str(amx_level), str(vnni_level)) == ("amx", "avx512vnni")       # the tiles ran, and the vectors
    for (m, k, n), a, v in zip([s for s in shapes for _ in "lg"], amx, vnni):
        assert a.shape == (m, n) and np.abs(a).max() > 0
        np.testing.assert_array_equal(a, v, err_msg=f"{m} x {k} x {n}")


def test_cpu_check_wants_vnni_and_takes_amx_tiles_where_there():
    base = frozenset(native.REQUIRED_FLAGS)
    assert native.cpu_runs_kernels(base) and native.cpu_runs_kernels(base | {"amx_tile", "amx_int8"})
    assert not native.cpu_runs_kernels(base - {"avx512_vnni"})
    assert native.kernel_instructions(base) == "AVX-512 VNNI"
    assert native.kernel_instructions(base | {"amx_tile", "amx_int8", "amx_bf16"}) == "AMX int8 tiles"


def test_a_load_without_the_library_says_how_to_build_it(tmp_path, monkeypatch):
    from kiln.contract.artifact import ArtifactError
    from kiln.engines.openvino import loader

    monkeypatch.setattr(native, "available", lambda: False)
    with pytest.raises(ArtifactError, match="kiln.engines.openvino.native.build"):
        loader._check_kiln_kernels(tmp_path)
    monkeypatch.setattr(native, "available", lambda: True)
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx2"}))
    with pytest.raises(ArtifactError, match="lacks .*avx512_vnni"):
        loader._check_kiln_kernels(tmp_path)


@needs_kernel
def test_a_build_whose_kiln_linears_fail_the_check_takes_the_plugins(tmp_path, monkeypatch):
    """An int8 build on kiln's linears that fails the quantization check is built again on OpenVINO's
    own linears (which must then pass), and the backend choice says why: a default build does not fail
    where the plugin's linears would do."""
    import json

    from kiln.compiler import build as build_module
    from kiln.compiler.passes.base import QuantCheckError
    from kiln.config import BuildConfig
    from kiln.contract.quant import QuantMode

    real_check = build_module._check_engine_quant
    checked = []

    def check_refusing_kiln_linears(built, *args):
        checked.append(built.engines[0]["options"]["kernels"])
        if built.engines[0]["options"]["kernels"]:
            raise QuantCheckError("top-1 agreement with fp32 0.5 < 0.9 (as if)")
        return real_check(built, *args)

    monkeypatch.setattr(build_module, "_check_engine_quant", check_refusing_kiln_linears)
    out = build_module.build(BuildConfig(source="tiny-llama", out=tmp_path / "a", quant=QuantMode.INT8))
    manifest = json.loads((out / "manifest.json").read_text())
    assert checked == [native.KERNELS, ""]
    assert manifest["engines"][0]["options"]["kernels"] == "" and "kernels" not in manifest["quant"]
    assert "kiln's int8 linears failed the build's check" in manifest["choices"]["backend"]["reason"]
    plan = manifest["plan"]                                     # the plan recorded is the rung that was built
    assert plan["rung"] == "openvino's own int8 linears" and plan["backend"] == manifest["choices"]["backend"]
    assert {r["kernel"]["op"] for r in plan["recipe"]["roles"]} == {"openvino"}


@needs_kernel
def test_a_graph_packed_another_way_is_refused_when_read(tmp_path):
    """Constants that do not fit kiln's packing (here comp per group of 64, not per column) stop the
    read with kiln's message instead of running the kernel past their ends."""
    k, n = 128, 32
    codes, scale, comp = quantize_weight(np.ones((n, k), np.float32))
    x = ov.opset13.parameter([-1, k], ov.Type.f32, name="x")
    consts = [ov.opset13.constant(a).output(0) for a in (codes, scale, np.stack([comp, comp]))]
    node = LinearI8([x.output(0), *consts, ov.opset13.constant(np.ones(k, np.float32)).output(0)])
    ov.save_model(ov.Model([node.output(0)], [x]), tmp_path / "m.xml", compress_to_fp16=False)
    core = ov.Core()
    core.add_extension(str(native.require()))
    with pytest.raises(RuntimeError, match="rebuild the artifact"):
        core.compile_model(core.read_model(tmp_path / "m.xml"), "CPU")
