"""Which fusions win on ONNX Runtime CPU: decode-step and prefill latency, side by side in one run.

    .venv/bin/python bench/bench_fusions.py [--model smollm2-135m] [--decode-iterations 100]

Variants: no fusion, each fusion alone, and all fusions. Every session: ORT_ENABLE_ALL, 2 intra-op threads, 1 inter-op
thread, sequential. Shapes: decode B=1, S=1 over a past of 256; prefill B=1, S=256, no past.
Variants run round-robin, one run each per iteration, so drift on the machine hits all of them
alike; the ratio is the median of each iteration's time over "none"'s in that same iteration.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort

from kiln.compiler.export.decoder_graph import build_decoder
from kiln.compiler.export.sources import load_source
from kiln.compiler.passes.fusion import FuseRMSNorm, FuseRotary, MergeProjections

VARIANTS = {
    "none": [],
    "rms_norm": [FuseRMSNorm],
    "rotary": [FuseRotary],
    "merge_projections": [MergeProjections],
    "rms_norm+rotary": [FuseRMSNorm, FuseRotary],
    "rms_norm+rotary+merge": [FuseRMSNorm, FuseRotary, MergeProjections],
    "all": [FuseRMSNorm, FuseRotary, MergeProjections],
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


def session(model_bytes: bytes, spin: bool) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    # NOTE: with spinning on, one session's idle workers keep spinning into the next session's
    # run; round-robin over six sessions on two cores then measures that, not the graphs.
    opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads, opts.inter_op_num_threads = 2, 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.log_severity_level = 3
    return ort.InferenceSession(model_bytes, opts, providers=["CPUExecutionProvider"])


def build_variants(base: onnx.ModelProto, spec, spin: bool, names: list[str]) -> dict[str, ort.InferenceSession]:
    sessions = {}
    for name in names:
        model = base
        passes = VARIANTS[name]
        for cls in passes:
            model = cls.for_spec(spec).run(model)
        sessions[name] = session(model.SerializeToString(), spin)
        del model
    return sessions


def time_one(sess: ort.InferenceSession, f: dict) -> float:
    t0 = time.perf_counter()
    sess.run(["logits"], f)
    return (time.perf_counter() - t0) * 1e3


@dataclass
class Cell:
    median_ms: float
    min_ms: float
    ratio: float          # median over iterations of this variant's time / "none"'s in the same iteration


def measure(sessions: dict, f: dict, iterations: int) -> dict[str, Cell]:
    """Round-robin, one run per variant per iteration, the order rotating each time.

    NOTE: the machine is shared and its load drifts within seconds, so each ratio is taken
    between runs a few milliseconds apart (paired), not between two medians minutes apart.
    """
    names = list(sessions)
    for name in names:
        for _ in range(2):
            time_one(sessions[name], f)                        # warm-up: allocations, prepacking
    samples: dict[str, list[float]] = {name: [] for name in names}
    for it in range(iterations):
        k = it % len(names)
        for name in names[k:] + names[:k]:
            samples[name].append(time_one(sessions[name], f))
    base = samples["none"]
    return {name: Cell(statistics.median(s), min(s), statistics.median(a / b for a, b in zip(s, base)))
            for name, s in samples.items()}


def max_logit_diff(sessions: dict, f: dict) -> dict[str, float]:
    ref = sessions["none"].run(["logits"], f)[0]
    return {name: float(np.abs(s.run(["logits"], f)[0] - ref).max()) for name, s in sessions.items()}


def print_table(cases: dict[str, dict[str, Cell]], errors: dict[str, float]) -> None:
    names = list(next(iter(cases.values())))
    head = f"{'variant':<20}" + "".join(f"{c + ' median ms':>26}{'min ms':>9}{'ratio':>7}"
                                       for c in cases) + f"{'max|Δlogit|':>13}"
    print(head)
    print("-" * len(head))
    for n in names:
        cells = "".join(f"{c[n].median_ms:>26.2f}{c[n].min_ms:>9.2f}{c[n].ratio:>7.3f}" for c in cases.values())
        print(f"{n:<20}{cells}{errors[n]:>13.2e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--decode-iterations", type=int, default=100)
    ap.add_argument("--prefill-iterations", type=int, default=12)
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--spin", action="store_true", help="let ORT's intra-op workers spin (default: off)")
    ap.add_argument("--past", type=int, default=256)
    ap.add_argument("--prefill-len", type=int, default=256)
    args = ap.parse_args()

    src = load_source(args.model)
    base = build_decoder(src.spec, src.weights)
    names = ["none", *[v for v in args.variants if v != "none"]]
    sessions = build_variants(base, src.spec, args.spin, names)
    decode = feeds(base, 1, 1, args.past)
    prefill = feeds(base, 1, args.prefill_len, 0)
    del base
    cases = {f"decode(past {args.past})": measure(sessions, decode, args.decode_iterations),
             f"prefill(S {args.prefill_len})": measure(sessions, prefill, args.prefill_iterations)}
    print(f"{args.model}: ORT {ort.__version__}, ORT_ENABLE_ALL, 2 intra-op threads, "
          f"spinning {'on' if args.spin else 'off'}; ratio = median of paired time/none")
    print_table(cases, max_logit_diff(sessions, decode))


if __name__ == "__main__":
    main()
