"""kiln's linear kernels alone (kiln/kernels), on SmolLM2-135M's linear shapes, as ms per call and
GFLOP/s, and one decode step's linears summed:
- q8: kiln.MatMulQ8 at each activation precision: int8 (accuracy_level 4), int16 (accuracy_level 2:
  pmaddwd over codes widened to int16 once per call) and float (accuracy_level 0: an f32 GEMM over
  the widened codes);
- q4_1: kiln.MatMulQ4Min (Q4_1) with int8 activations, the int4 builds' linears;
- linear_i8: the OpenVINO extension's kiln.LinearI8 kernel (int8 per output channel, u8 activations),
  called without OpenVINO's graph around it, on OpenVINO's threads (where the CPU runs it).

    .venv/bin/python bench/bench_linear_kernels.py [--rows 1 32 512] [--threads 2] [--kernels q8 q4_1 linear_i8]

What a level can win depends on the CPU: with VNNI, int8's vpdpbusd does 4 products per lane per
instruction; on AVX2 without it, pmaddwd's 16 int16 products per instruction are twice an FMA's 8,
where int8 (pmaddubsw, then pmaddwd to widen its 16-bit sums, and |x| / sign fix-ups) gains little.
"""

from __future__ import annotations

import argparse
import ctypes
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from kiln.compiler.passes.q4min_linear import pack_tiles, pack_tiles_q8, q4min_blocks, q4min_node, q8_blocks
from kiln.engines.ort import native

# (K, N, linears per step): SmolLM2-135M fused (q/k/v merged, gate/up merged), 30 layers, and the head
SMOLLM2_LINEARS = ((576, 960, 30), (576, 576, 30), (576, 3072, 30), (1536, 576, 30), (576, 49152, 1))
LEVELS = (4, 2, 0)
LEVEL_NAMES = {4: "int8", 2: "int16", 0: "float"}


def q8_session(k: int, n: int, packed: np.ndarray, level: int, threads: int,
               op_type: str = native.OP_TYPE_Q8) -> ort.InferenceSession:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, k])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, n])
    node = q4min_node("x", "y", "b", k, n, "q8", level, op_type)
    graph = helper.make_graph([node], "q8", [x], [y], [numpy_helper.from_array(packed, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(native.OP_DOMAIN, 1)])
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.register_custom_ops_library(str(native.require()))
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def seconds_per_call(session: ort.InferenceSession, x: np.ndarray, budget_s: float = 0.5) -> float:
    return seconds_per(lambda: session.run(None, {"x": x}), budget_s)


def seconds_per(call, budget_s: float = 0.5) -> float:
    call()
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < budget_s:
        call()
        calls += 1
    return (time.perf_counter() - start) / calls


def report(name: str, rows: int, timings: list[tuple[int, int, int, float]]) -> None:
    """One kernel's lines: (K, N, linears per step, seconds) per shape, then the step's sum."""
    for k, n, _, took in timings:
        print(f"rows {rows:4d}  {k:5d} x {n:5d}: {name} {took * 1e3:7.3f} ms ({2 * rows * k * n / took / 1e9:4.0f} GFLOP/s)")
    print(f"rows {rows:4d}  a step's linears: {name} {sum(t * count for _, _, count, t in timings) * 1e3:.1f} ms")


def bench_q4_1(rows_list: list[int], threads: int, rng: np.random.Generator) -> None:
    print(f"kiln.MatMulQ4Min (Q4_1, int8 activations) on {native.isa()}, {threads} threads")
    for rows in rows_list:
        timings = []
        for k, n, count in SMOLLM2_LINEARS:
            packed = pack_tiles(q4min_blocks(rng.normal(0, 0.05, (k, n)).astype(np.float32)))
            x = rng.normal(0, 1, (rows, k)).astype(np.float32)
            timings.append((k, n, count, seconds_per_call(q8_session(k, n, packed, 4, threads, native.OP_TYPE), x)))
        report("q4_1", rows, timings)


def bench_linear_i8(rows_list: list[int], rng: np.random.Generator) -> None:
    from kiln.compiler.backends.openvino.int8_linears import quantize_weight
    from kiln.engines.openvino import native as ov_native

    if not ov_native.usable():
        print("kiln.LinearI8: not built, or this CPU does not run it (AVX-512 VNNI, no AMX): skipped")
        return
    fn = ctypes.CDLL(str(ov_native.require())).kiln_ov_linear_i8
    p, size = ctypes.c_void_p, ctypes.c_size_t
    fn.argtypes = [p, p, size, size, p, p, p, size, p]
    print("kiln.LinearI8 (int8 per output channel), OpenVINO's threads")
    for rows in rows_list:
        timings = []
        for k, n, count in SMOLLM2_LINEARS:
            codes, scale, comp = quantize_weight(rng.normal(0, 0.05, (n, k)).astype(np.float32))
            x, sm = rng.normal(0, 1, (rows, k)).astype(np.float32), np.ones(k, np.float32)
            y = np.empty((rows, n), np.float32)
            args = (x.ctypes.data, sm.ctypes.data, rows, k, codes.ctypes.data, scale.ctypes.data, comp.ctypes.data,
                    n, y.ctypes.data)
            timings.append((k, n, count, seconds_per(lambda: fn(*args))))
        report("linear_i8", rows, timings)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32, 512])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kernels", nargs="+", choices=("q8", "q4_1", "linear_i8"), default=["q8", "q4_1", "linear_i8"])
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    if "q8" in args.kernels:
        bench_q8(args.rows, args.threads, rng)
    if "q4_1" in args.kernels:
        bench_q4_1(args.rows, args.threads, rng)
    if "linear_i8" in args.kernels:
        bench_linear_i8(args.rows, rng)


def bench_q8(rows_list: list[int], threads: int, rng: np.random.Generator) -> None:
    print(f"kiln.MatMulQ8 on {native.isa()}, {threads} threads")
    for rows in rows_list:
        step = dict.fromkeys(LEVELS, 0.0)
        for k, n, count in SMOLLM2_LINEARS:
            packed = pack_tiles_q8(q8_blocks(rng.normal(0, 0.05, (k, n)).astype(np.float32)))
            x = rng.normal(0, 1, (rows, k)).astype(np.float32)
            took = {lv: seconds_per_call(q8_session(k, n, packed, lv, threads), x) for lv in LEVELS}
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
