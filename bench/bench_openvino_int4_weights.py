"""Same-run micro-benchmark of OpenVINO CPU weight formats on a stack of SmolLM2-shaped linears.

    .venv/bin/python -m bench.bench_openvino_int4_weights --layers 30 --rows 1 512 \\
        --precisions f32 bf16 --dq 0 32 64 --threads 1

Each layer is SmolLM2's fused linears (hidden 576, intermediate 1536): x -> qkv [576->960] -> slice
-> o [576->576] -> +x -> gate_up [576->3072] -> silu(gate)*up -> down [1536->576] -> +x. The
weights are Q4_1 blocks (w = d·q + m per block of 32 along K, d and m f16, like the GGUF), and each
variant holds them in one weight format:

    f32          f32 constants
    int8_sym     NNCF INT8_SYM per output channel (kiln's openvino int8)
    int4_sym     NNCF INT4_SYM, groups of 32
    int4_asym    NNCF INT4_ASYM, groups of 32 (u4 codes, u4 zero points)
    q4_fzp16     the Q4_1 codes as u4, f16 zero point -m/d and f16 scale d per group (exact Q4_1)
    q4_fzp32     the same decompression in f32 (Convert(u4->f32), Subtract f32, Multiply f32)
    q4_off32     exact Q4_1 as i4 codes q-8 with scale d (no zero point) + a block-offset side
                 product (x summed per block of 32)·(m + 8d), the offsets f32 (q4_weights.offset_linear)
    q4_off8      the same, the offsets 8-bit per output channel
    q4_aug1/2    exact-ish Q4_1 in ONE i4 FullyConnected over [x, block sums of x]: the offsets
                 m + 8d as 1 or 2 extra 4-bit digits (q4_weights.augmented_linear)
    ort_q4sym    the same stack in onnxruntime: MatMulNBits 4-bit symmetric, blocks of 32,
                 accuracy_level 4 (onnxruntime-genai's int4 CPU form), timed in the same loop
    ort_q4zp     MatMulNBits 4-bit with integer (u4) zero points (kiln's ort int4 form)

For every (inference precision, DYNAMIC_QUANTIZATION_GROUP_SIZE) the variants are compiled side by
side and their calls alternate; the median of each is printed with its ratio to the first variant.
"rel err vs f32" is the stack output's max error over its max against the f32 variant compiled
with the same options: a numeric sanity check at M=1 (at M=512 the 30 random layers amplify any
difference, so it reads ~1 for every lossy variant). --graph prints, per variant, what the plugin made of the first linear (node types and the
element types of its weight inputs) to show whether the decompression was folded into the
FullyConnected kernel or constant-folded to a dense weight.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import numpy as np
import openvino as ov
import openvino.opset13 as ops


from kiln.compiler.backends.openvino.q4_weights import (
    Q4Blocks, augmented_linear, decompression_subgraph, offset_linear)

HIDDEN, INTER, QKV = 576, 1536, 960
GROUP = 32
CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}
VARIANTS = ("f32", "int8_sym", "int4_sym", "int4_asym", "q4_fzp16", "q4_fzp32", "q4_off32", "q4_off8",
            "q4_aug1", "q4_aug2", "ort_q4sym", "ort_q4zp")
ORT_VARIANTS = ("ort_q4sym", "ort_q4zp")


def q4_1_weight(rng: np.random.Generator, n: int, k: int) -> Q4Blocks:
    """Random Q4_1 blocks of an [N, K] weight: codes 0..15, d > 0, m about -8d (like real layers)."""
    codes = rng.integers(0, 16, size=(n, k), dtype=np.uint8)
    d = (rng.uniform(0.5, 1.5, size=(n, k // GROUP)) * 0.004).astype(np.float16)
    m = (-8.0 * d.astype(np.float32) * rng.uniform(0.8, 1.2, size=d.shape)).astype(np.float16)
    return Q4Blocks(codes, d, m)


def weights_for(layers: int, seed: int = 0) -> list[dict[str, Q4Blocks]]:
    rng = np.random.default_rng(seed)
    return [{"qkv": q4_1_weight(rng, QKV, HIDDEN), "o": q4_1_weight(rng, HIDDEN, HIDDEN),
             "gate_up": q4_1_weight(rng, 2 * INTER, HIDDEN), "down": q4_1_weight(rng, HIDDEN, INTER)}
            for _ in range(layers)]


def linear(x, blocks: Q4Blocks, variant: str, name: str):
    """MatMul(x, W^T) with W [N, K] in the variant's format (NNCF variants start from f32)."""
    if variant in ("q4_aug1", "q4_aug2"):
        return augmented_linear(x, blocks, int(variant[-1]), name)
    if variant in ("q4_off32", "q4_off8"):
        return offset_linear(x, blocks, "f32" if variant == "q4_off32" else "i8", name)
    if variant in ("q4_fzp16", "q4_fzp32"):
        w = decompression_subgraph(blocks, np.float16 if variant == "q4_fzp16" else np.float32, name)
    else:
        w = ops.constant(blocks.dequantize(), name=name)
    return ops.matmul(x, w, transpose_a=False, transpose_b=True)


def rms_norm(h):
    ms = ops.reduce_mean(ops.multiply(h, h), ops.constant(np.array([-1], np.int64)), keep_dims=True)
    return ops.divide(h, ops.sqrt(ops.add(ms, ops.constant(np.float32(1e-5)))))


def stack_model(weights: list[dict[str, Q4Blocks]], variant: str) -> ov.Model:
    x = ops.parameter([-1, HIDDEN], ov.Type.f32, name="x")
    h = x
    for i, layer in enumerate(weights):
        qkv = linear(rms_norm(h), layer["qkv"], variant, f"l{i}.qkv")
        q = ops.slice(qkv, np.array([0]), np.array([HIDDEN]), np.array([1]), np.array([1]))
        h = ops.add(h, linear(q, layer["o"], variant, f"l{i}.o"))
        gate, up = ops.split(linear(rms_norm(h), layer["gate_up"], variant, f"l{i}.gate_up"), 1, 2).outputs()
        h = ops.add(h, linear(ops.multiply(ops.swish(gate), up), layer["down"], variant, f"l{i}.down"))
    model = ov.Model([h], [x], f"stack_{variant}")
    if variant in ("int8_sym", "int4_sym", "int4_asym"):
        import nncf

        if variant == "int8_sym":
            nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT8_SYM)
        else:
            mode = nncf.CompressWeightsMode.INT4_SYM if variant == "int4_sym" else nncf.CompressWeightsMode.INT4_ASYM
            nncf.compress_weights(model, mode=mode, group_size=GROUP, ratio=1.0, all_layers=True)
    return model


def ort_stack(weights: list[dict[str, Q4Blocks]], variant: str, threads: int):
    """An onnxruntime session of the same stack on MatMulNBits (weights requantized by onnxruntime's
    own block quantizer), wrapped to answer like an OpenVINO infer request."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from kiln.compiler.passes.quant_tables import weight_quantizer

    quantizer = weight_quantizer(4, GROUP, variant == "ort_q4sym")
    nodes, inits = [], []
    count = iter(range(10**6))

    def node(op, inputs, **attrs):
        out = f"t{next(count)}"
        domain = attrs.pop("domain", "")
        nodes.append(helper.make_node(op, inputs, [out], domain=domain, **attrs))
        return out

    def const(name, array):
        inits.append(numpy_helper.from_array(array, name))
        return name

    eps, axes = const("eps", np.array(1e-5, np.float32)), const("axes", np.array([-1], np.int64))

    def norm(h):
        return node("Div", [h, node("Sqrt", [node("Add", [node("ReduceMean", [node("Mul", [h, h]), axes]), eps])])])

    def lin(h, blocks, name):
        w = blocks.dequantize().T                                  # [K, N]
        packed, scales, zp = quantizer.qbits_block_quant(np.ascontiguousarray(w))
        ins = [h, const(f"{name}.q", packed), const(f"{name}.s", scales)]
        if variant == "ort_q4zp":
            ins.append(const(f"{name}.zp", zp))
        k, n = w.shape
        return node("MatMulNBits", ins, domain="com.microsoft", K=k, N=n, bits=4, block_size=GROUP,
                    accuracy_level=4)

    starts, ends, one = const("s0", np.array([0], np.int64)), const("e0", np.array([HIDDEN], np.int64)), \
        const("one", np.array([1], np.int64))
    h = "x"
    for i, layer in enumerate(weights):
        q = node("Slice", [lin(norm(h), layer["qkv"], f"l{i}.qkv"), starts, ends, one])
        h = node("Add", [h, lin(q, layer["o"], f"l{i}.o")])
        gu = lin(norm(h), layer["gate_up"], f"l{i}.gate_up")
        gate, up = f"g{i}", f"u{i}"
        nodes.append(helper.make_node("Split", [gu], [gate, up], axis=1, num_outputs=2))
        act = node("Mul", [node("Mul", [gate, node("Sigmoid", [gate])]), up])
        h = node("Add", [h, lin(act, layer["down"], f"l{i}.down")])
    graph = helper.make_graph(nodes, "stack", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, HIDDEN])],
                              [helper.make_tensor_value_info(h, TensorProto.FLOAT, [None, HIDDEN])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return OrtRequest(ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]))


class OrtRequest:
    def __init__(self, session):
        self.session, self.out = session, None

    def infer(self, feeds: dict):
        self.out = self.session.run(None, {"x": feeds[0]})[0]

    def get_output_tensor(self, i: int):
        return type("T", (), {"data": self.out})


def describe_first_linear(compiled: ov.CompiledModel) -> str:
    """The runtime graph's layer types and the precisions of the first FullyConnected's inputs."""
    runtime = compiled.get_runtime_model()
    types: dict[str, int] = {}
    first = None
    for op in runtime.get_ordered_ops():
        rt = op.get_rt_info()
        kind = _rt(rt, "layerType", op.get_type_name())
        types[kind] = types.get(kind, 0) + 1
        if first is None and kind == "FullyConnected":
            first = op
    detail = ""
    if first is not None:
        rt = first.get_rt_info()
        ins = [f"{i.get_element_type().get_type_name()}{i.get_partial_shape()}" for i in first.inputs()]
        detail = (f" | first FC: impl={_rt(rt, 'primitiveType')} runtimePrecision={_rt(rt, 'runtimePrecision')} "
                  f"inputs={ins}")
    return ", ".join(f"{k}x{v}" for k, v in sorted(types.items())) + detail


def _rt(rt, key: str, default: str = "?") -> str:
    return str(rt[key].value) if key in rt else default


def time_calls(requests: dict[str, ov.InferRequest], x: np.ndarray, calls: int, clock) -> dict[str, list[float]]:
    times = {v: [] for v in requests}
    for i in range(calls + 2):
        for v, req in requests.items():
            t0 = clock()
            req.infer({0: x})
            if i >= 2:
                times[v].append(clock() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 512], help="M: 1 = a decode, 512 = a prefill")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--precisions", nargs="+", default=["f32", "bf16"])
    ap.add_argument("--dq", type=int, nargs="+", default=[0, 32, 64], help="DYNAMIC_QUANTIZATION_GROUP_SIZE values")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--calls", type=int, default=30, help="timed calls per variant at M=1 (M>1: a tenth, >= 3)")
    ap.add_argument("--clock", choices=CLOCKS, default="cpu",
                    help="cpu: the process's CPU time per call (robust on a shared machine; use --threads 1); wall")
    ap.add_argument("--graph", action="store_true", help="print what the plugin made of each variant")
    args = ap.parse_args()

    weights = weights_for(args.layers)
    core = ov.Core()
    models = {v: stack_model(weights, v) for v in args.variants if v not in ORT_VARIANTS}
    ort_requests = {v: ort_stack(weights, v, args.threads) for v in args.variants if v in ORT_VARIANTS}
    rng = np.random.default_rng(1)
    ref_out = {}
    print(f"openvino {ov.get_version()}, {args.layers} layers, {args.threads} thread(s), {args.clock} time")
    for precision in args.precisions:
        for dq in args.dq:
            props = {"INFERENCE_NUM_THREADS": str(args.threads), "PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": "1",
                     "INFERENCE_PRECISION_HINT": precision, "DYNAMIC_QUANTIZATION_GROUP_SIZE": str(dq)}
            compiled = {v: core.compile_model(m, "CPU", props) for v, m in models.items()}
            requests = {**{v: c.create_infer_request() for v, c in compiled.items()}, **ort_requests}
            for rows in args.rows:
                x = rng.standard_normal((rows, HIDDEN)).astype(np.float32)
                calls = args.calls if rows == 1 else max(3, args.calls // 10)
                times = time_calls(requests, x, calls, CLOCKS[args.clock])
                outs = {v: r.get_output_tensor(0).data.copy() for v, r in requests.items()}
                ref = outs.get("f32")
                base = None
                for v in requests:
                    med, low = statistics.median(times[v]) * 1e3, min(times[v]) * 1e3
                    base = base or med
                    err = ""
                    if ref is not None:
                        err = f"  rel err vs f32 {np.abs(outs[v] - ref).max() / np.abs(ref).max():.2e}"
                    print(f"{precision:>5} dq={dq:<3} M={rows:<4} {v:<10} {med:9.3f} ms  x{med / base:5.2f}  "
                          f"(min {low:9.3f}){err}")
                ref_out[(precision, dq, rows)] = ref
                if args.graph:          # after the calls: the runtime graph names the kernels they used
                    for v, c in compiled.items():
                        print(f"  [{precision} dq={dq} M={rows}] {v}: {describe_first_linear(c)}")
            del requests, compiled
            gc.collect()


if __name__ == "__main__":
    main()
