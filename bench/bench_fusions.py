"""Which fusions win on ONNX Runtime CPU: decode-step and prefill latency, side by side in one run.

    .venv/bin/python bench/bench_fusions.py [--model smollm2-135m] [--rounds 5]

Variants: no fusion, each fusion alone (FuseSkipRMSNorm needs FuseRMSNorm first, so its row
is the pair), and all fusions. Every session: ORT_ENABLE_ALL, 2 intra-op threads, 1 inter-op
thread, sequential. Shapes: decode B=1, S=1 over a past of 256; prefill B=1, S=256, no past.
Rounds interleave the variants so that drift on the machine hits all of them alike; each cell
is the median over all rounds' runs, and the ratio is against "none" from the same run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnx
import onnxruntime as ort

from kiln.export.decoder_graph import build_decoder
from kiln.export.sources import load_source
from kiln.passes.fusion import FuseRMSNorm, FuseRotary, FuseSkipRMSNorm, MergeProjections

VARIANTS = {
    "none": [],
    "rms_norm": [FuseRMSNorm],
    "rms_norm+skip": [FuseRMSNorm, FuseSkipRMSNorm],
    "rotary": [FuseRotary],
    "merge_projections": [MergeProjections],
    "all": [FuseRMSNorm, FuseSkipRMSNorm, FuseRotary, MergeProjections],
}


def feeds(model: onnx.ModelProto, batch: int, seq: int, past: int, seed: int = 0) -> dict:
    """The standard decoder interface at the given sizes: no padding, positions past..past+seq."""
    rng = np.random.default_rng(seed)
    vocab = next(o for o in model.graph.output if o.name == "logits").type.tensor_type.shape.dim[-1].dim_value
    out = {"input_ids": rng.integers(0, vocab, (batch, seq)),
           "position_ids": np.tile(np.arange(past, past + seq, dtype=np.int64), (batch, 1)),
           "attention_mask": np.ones((batch, past + seq), np.int64)}
    for i in model.graph.input:
        if i.name.startswith("past_key_values."):
            d = i.type.tensor_type.shape.dim
            out[i.name] = rng.normal(0, 1, (batch, d[1].dim_value, past, d[3].dim_value)).astype(np.float32)
    return out


def session(model_bytes: bytes) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads, opts.inter_op_num_threads = 2, 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.log_severity_level = 3
    return ort.InferenceSession(model_bytes, opts, providers=["CPUExecutionProvider"])


def build_variants(base: onnx.ModelProto, spec) -> dict[str, ort.InferenceSession]:
    sessions = {}
    for name, passes in VARIANTS.items():
        model = base
        for cls in passes:
            model = cls.for_spec(spec).run(model)
        sessions[name] = session(model.SerializeToString())
        del model
    return sessions


def time_runs(sess: ort.InferenceSession, f: dict, runs: int) -> list[float]:
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        sess.run(["logits"], f)
        samples.append((time.perf_counter() - t0) * 1e3)
    return samples


def measure(sessions: dict, f: dict, rounds: int, runs: int) -> dict[str, float]:
    for sess in sessions.values():
        time_runs(sess, f, 2)                                   # warm-up: allocations, prepacking
    samples: dict[str, list[float]] = {name: [] for name in sessions}
    for _ in range(rounds):
        for name, sess in sessions.items():
            samples[name] += time_runs(sess, f, runs)
    return {name: statistics.median(s) for name, s in samples.items()}


def max_logit_diff(sessions: dict, f: dict) -> dict[str, float]:
    ref = sessions["none"].run(["logits"], f)[0]
    return {name: float(np.abs(s.run(["logits"], f)[0] - ref).max()) for name, s in sessions.items()}


def print_table(cases: dict[str, dict[str, float]], errors: dict[str, float]) -> None:
    names = list(next(iter(cases.values())))
    head = f"{'variant':<20}" + "".join(f"{c + ' ms':>20}{'ratio':>8}" for c in cases) + f"{'max|Δlogit|':>14}"
    print(head)
    print("-" * len(head))
    for n in names:
        cells = "".join(f"{ms[n]:>20.3f}{ms[n] / ms['none']:>8.3f}" for ms in cases.values())
        print(f"{n:<20}{cells}{errors[n]:>14.2e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--decode-runs", type=int, default=30)
    ap.add_argument("--prefill-runs", type=int, default=3)
    ap.add_argument("--past", type=int, default=256)
    ap.add_argument("--prefill-len", type=int, default=256)
    args = ap.parse_args()

    src = load_source(args.model)
    base = build_decoder(src.spec, src.weights)
    sessions = build_variants(base, src.spec)
    decode = feeds(base, 1, 1, args.past)
    prefill = feeds(base, 1, args.prefill_len, 0)
    del base
    cases = {f"decode(past {args.past})": measure(sessions, decode, args.rounds, args.decode_runs),
             f"prefill(S {args.prefill_len})": measure(sessions, prefill, args.rounds, args.prefill_runs)}
    print(f"{args.model}: ORT {ort.__version__}, ORT_ENABLE_ALL, 2 intra-op threads; median ms, ratio vs none")
    print_table(cases, max_logit_diff(sessions, decode))


if __name__ == "__main__":
    main()
