"""Hardening, second round (issue 45, item 12): kiln's native operations do not trust a graph's
shapes or its integer inputs. kiln.PagedAttention (ONNX Runtime) refuses a past length near
INT64_MAX (its block count overflowed past the table check), one that puts positions past the
kernel's int, and dimensions that do not fit an int; kiln.LinearI8 / kiln.GateUpI8 (OpenVINO) check
their packing when x's channels are dynamic, the gate and up linears against each other, and the
tensors again at run time. The runs that could crash the old code run in a child process."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

# A child that builds one kiln.PagedAttention session and runs it on the inputs it is given.
ATTENTION_CHILD = textwrap.dedent("""
    import json, sys
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper
    from kiln.engines.ort import native

    spec = json.loads(sys.argv[1])
    names = ("q", "k", "v", "key_cache", "value_cache", "block_tables", "past_lens")
    types = [TensorProto.FLOAT] * 5 + [TensorProto.INT64] * 2
    node = helper.make_node("PagedAttention", list(names), ["out"], domain=native.OP_DOMAIN,
                            num_heads=spec["heads"], kv_num_heads=spec["kv_heads"], scale=0.25)
    graph = helper.make_graph([node], "paged", [helper.make_tensor_value_info(n, t, None) for n, t in zip(names, types)],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(native.OP_DOMAIN, 1)])
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    native.register(opts)
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    b, s, hd = spec["batch"], spec["seq"], spec["head_dim"]
    pool = np.zeros(spec["pool"], np.float32)
    feeds = {"q": np.zeros((b, s, spec["heads"] * hd), np.float32), "k": np.zeros((b, s, spec["kv_heads"] * hd), np.float32),
             "v": np.zeros((b, s, spec["kv_heads"] * hd), np.float32), "key_cache": pool, "value_cache": pool.copy(),
             "block_tables": np.zeros(spec["tables"], np.int64), "past_lens": np.array(spec["past_lens"], np.int64)}
    try:
        out = sess.run(None, feeds)[0]
    except Exception as e:
        print("REFUSED", e)
    else:
        print("RAN", out.shape, bool(np.isfinite(out).all()))
""")


def _attend(**spec) -> str:
    done = subprocess.run([sys.executable, "-c", ATTENTION_CHILD, json.dumps(spec)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, f"the session's process died ({done.returncode}): {done.stderr[-2000:]}"
    return done.stdout


def test_a_past_length_near_int64_max_is_refused_not_overflowed(library):
    out = _attend(batch=1, seq=1, heads=4, kv_heads=2, head_dim=16, pool=[2, 8, 4, 16], tables=[1, 3],
                  past_lens=[2 ** 63 - 2])
    assert out.startswith("REFUSED") and "longer than its row" in out, out


def test_a_past_length_past_the_kernels_int_positions_is_refused(library):
    """2^31 positions of one block used over and over (the table may name a block twice): the
    blocks fit the table, the positions do not fit the kernel's int."""
    out = _attend(batch=1, seq=1, heads=1, kv_heads=1, head_dim=1, pool=[1, 1, 1 << 20, 1], tables=[1, 2049],
                  past_lens=[2 ** 31])
    assert out.startswith("REFUSED") and "2^31 - 1" in out, out


def test_dimensions_that_do_not_fit_an_int_are_refused(library):
    """An empty batch whose block table is 2^31 blocks wide: narrowed to int it was -2^31."""
    out = _attend(batch=0, seq=1, heads=4, kv_heads=2, head_dim=16, pool=[2, 8, 4, 16], tables=[0, 2 ** 31],
                  past_lens=[])
    assert out.startswith("REFUSED") and "exceeds 2^31 - 1" in out, out


# ---- kiln.LinearI8 / kiln.GateUpI8 ------------------------------------------------------------

def _openvino():
    ov = pytest.importorskip("openvino")
    from kiln.engines.openvino import native
    if not native.usable():
        pytest.skip("kiln's OpenVINO op library is not built, or this CPU lacks AVX-512 VNNI")
    return ov, native


def _compile(ov, native, outputs, params, tmp_path):
    ov.save_model(ov.Model(outputs, params), tmp_path / "m.xml", compress_to_fp16=False)
    core = ov.Core()
    core.add_extension(str(native.require()))
    return core.compile_model(core.read_model(tmp_path / "m.xml"), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})


def test_linear_packing_is_checked_when_xs_channels_are_dynamic(tmp_path):
    """x [?, ?]: codes packed for 128 channels, smoothing factors for 64. The old check needed x's
    K static and let this through to the kernel."""
    ov, native = _openvino()
    from kiln.compiler.backends.openvino.int8_linears import LinearI8, quantize_weight
    codes, scale, comp = quantize_weight(np.ones((32, 128), np.float32))
    x = ov.opset13.parameter([-1, -1], ov.Type.f32, name="x")
    node = LinearI8([x.output(0), *(ov.opset13.constant(a).output(0) for a in (codes, scale, comp)),
                     ov.opset13.constant(np.ones(64, np.float32)).output(0)])
    with pytest.raises(RuntimeError, match="rebuild the artifact"):
        _compile(ov, native, [node.output(0)], [x], tmp_path)


def test_the_gate_and_up_linears_must_have_the_same_columns(tmp_path):
    ov, native = _openvino()
    from kiln.compiler.backends.openvino.int8_linears import GateUpI8, quantize_weight
    k = 64
    x = ov.opset13.parameter([-1, k], ov.Type.f32, name="x")
    consts = [ov.opset13.constant(a).output(0) for n in (32, 48) for a in quantize_weight(np.ones((n, k), np.float32))]
    node = GateUpI8([x.output(0), *consts, ov.opset13.constant(np.ones(k, np.float32)).output(0)])
    with pytest.raises(RuntimeError, match="gate linear has 32 columns and the up linear 48"):
        _compile(ov, native, [node.output(0)], [x], tmp_path)


LINEAR_CHILD = textwrap.dedent("""
    import sys
    import numpy as np
    import openvino as ov
    from kiln.compiler.backends.openvino.int8_linears import LinearI8, quantize_weight
    from kiln.engines.openvino import native
    codes, scale, comp = quantize_weight(np.ones((32, 128), np.float32))
    x = ov.opset13.parameter([-1, -1], ov.Type.f32, name="x")
    sm = ov.opset13.parameter([-1], ov.Type.f32, name="sm")        # left dynamic: checked at run time
    node = LinearI8([x.output(0), *(ov.opset13.constant(a).output(0) for a in (codes, scale, comp)), sm.output(0)])
    ov.save_model(ov.Model([node.output(0)], [x, sm]), sys.argv[1], compress_to_fp16=False)
    core = ov.Core()
    core.add_extension(str(native.require()))
    compiled = core.compile_model(core.read_model(sys.argv[1]), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    try:
        out = compiled([np.ones((2, 4096), np.float32), np.ones(4096, np.float32)])[0]   # 4096 channels, codes for 128
    except Exception as e:
        print("REFUSED", e)
    else:
        print("RAN", out.shape)
""")


def test_a_linears_tensors_are_checked_at_run_time(tmp_path):
    """Shapes the graph leaves dynamic are held to the packing when the tensors arrive. NOTE: this
    one passed before the change too (the CPU plugin validates the node again with the run's
    shapes); it guards that path, and evaluate() now checks the tensors itself as well."""
    _openvino()
    done = subprocess.run([sys.executable, "-c", LINEAR_CHILD, str(tmp_path / "m.xml")], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, f"the process died ({done.returncode}): {done.stderr[-2000:]}"
    assert done.stdout.startswith("REFUSED") and "rebuild the artifact" in done.stdout, done.stdout
