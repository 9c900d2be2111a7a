"""kiln.MatMulQ8 alone, on SmolLM2-135M's linear shapes, at each activation precision: int8
(accuracy_level 4), int16 (accuracy_level 2: pmaddwd over codes widened to int16 once per call) and
float (accuracy_level 0: an f32 GEMM over the widened codes), as ms per call and GFLOP/s, and one
decode step's linears summed.

    .venv/bin/python bench/bench_linear_kernels.py [--rows 1 32 512] [--threads 2]

What a level can win depends on the CPU: with VNNI, int8's vpdpbusd does 4 products per lane per
instruction; on AVX2 without it, pmaddwd's 16 int16 products per instruction are twice an FMA's 8,
where int8 (pmaddubsw, then pmaddwd to widen its 16-bit sums, and |x| / sign fix-ups) gains little.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from kiln.compiler.passes.q4min_linear import pack_tiles_q8, q4min_node, q8_blocks
from kiln.engines.ort import native

# (K, N, linears per step): SmolLM2-135M fused (q/k/v merged, gate/up merged), 30 layers, and the head
SMOLLM2_LINEARS = ((576, 960, 30), (576, 576, 30), (576, 3072, 30), (1536, 576, 30), (576, 49152, 1))
LEVELS = (4, 2, 0)
LEVEL_NAMES = {4: "int8", 2: "int16", 0: "float"}


def q8_session(k: int, n: int, packed: np.ndarray, level: int, threads: int) -> ort.InferenceSession:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, k])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, n])
    node = q4min_node("x", "y", "b", k, n, "q8", level, native.OP_TYPE_Q8)
    graph = helper.make_graph([node], "q8", [x], [y], [numpy_helper.from_array(packed, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(native.OP_DOMAIN, 1)])
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.register_custom_ops_library(str(native.require()))
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def seconds_per_call(session: ort.InferenceSession, x: np.ndarray, budget_s: float = 0.5) -> float:
    session.run(None, {"x": x})
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < budget_s:
        session.run(None, {"x": x})
        calls += 1
    return (time.perf_counter() - start) / calls


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32, 512])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    print(f"kiln.MatMulQ8 on {native.isa()}, {args.threads} threads")
    for rows in args.rows:
        step = dict.fromkeys(LEVELS, 0.0)
        for k, n, count in SMOLLM2_LINEARS:
            packed = pack_tiles_q8(q8_blocks(rng.normal(0, 0.05, (k, n)).astype(np.float32)))
            x = rng.normal(0, 1, (rows, k)).astype(np.float32)
            took = {lv: seconds_per_call(q8_session(k, n, packed, lv, args.threads), x) for lv in LEVELS}
            for lv in LEVELS:
                step[lv] += took[lv] * count
            flops = 2 * rows * k * n
            cells = "  ".join(f"{LEVEL_NAMES[lv]} {took[lv] * 1e3:7.3f} ms ({flops / took[lv] / 1e9:4.0f} GFLOP/s)"
                              for lv in LEVELS)
            print(f"rows {rows:4d}  {k:5d} x {n:5d}: {cells}")
        cells = ", ".join(f"{LEVEL_NAMES[lv]} {step[lv] * 1e3:.1f} ms" for lv in LEVELS)
        print(f"rows {rows:4d}  a step's linears: {cells} (float / int16 time {step[0] / step[2]:.2f})")


if __name__ == "__main__":
    main()
