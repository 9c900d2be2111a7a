"""Engine-level A/B of the paged graph's attention cores on hand-made PagedBatches (no scheduler):
decode steps at 1 and 32 sequences, and batches of chunks that continue their sequences, which a
GroupQueryAttention core runs one sequence per call (passes/attention_gqa.py) and the standard core
in one padded call. Rounds interleave the artifacts; each round keeps the fastest of --repeat runs
of a shape, and the median over rounds is printed with ratios to the first artifact. --profile DIR
adds ORT's per-op profile of decode steps (x1 and x32, past 300) of each.

    kiln build smollm2-135m --quant int8 -o /tmp/a-int8-standard
    kiln build smollm2-135m --quant int8 --attention gqa -o /tmp/a-int8-gqa
    .venv/bin/python bench/bench_attention_calls.py /tmp/a-int8-standard /tmp/a-int8-gqa [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import onnxruntime as ort

from kiln.contract.artifact import EngineArtifact
from kiln.contract.engine import PagedBatch
from kiln.engines.load import load_engine
from kiln.engines.ort.session import cpu_session, session_options

# name -> (past_len, new tokens) per sequence
SHAPES = {
    "decode x1 (past 300)": [(300, 1)],
    "decode x32 (past 300)": [(300, 1)] * 32,
    "4 chunks of 128 (past 256)": [(256, 128)] * 4,
    "8 chunks of 4 (past 200; batched speculative verification)": [(200, 4)] * 8,
    "32 chunks of 13 (past 64; prefix-cache hits)": [(64, 13)] * 32,
    "first chunks 32 x 13": [(0, 13)] * 32,
}


def paged_batch(sequences: list[tuple[int, int]], block_size: int, vocab: int, seed: int = 0) -> PagedBatch:
    rng = np.random.default_rng(seed)
    counts = [-(-(p + n) // block_size) for p, n in sequences]
    tables = np.split(np.arange(sum(counts), dtype=np.int64), np.cumsum(counts)[:-1])
    spans = [np.arange(p, p + n, dtype=np.int64) for p, n in sequences]
    ends = np.cumsum([n for _, n in sequences]) - 1
    return PagedBatch(input_ids=rng.integers(0, vocab, int(ends[-1]) + 1).astype(np.int64),
                      positions=np.concatenate(spans), query_lens=np.array([n for _, n in sequences], np.int64),
                      past_lens=np.array([p for p, _ in sequences], np.int64), block_tables=tables,
                      slot_mapping=np.concatenate([t[s // block_size] * block_size + s % block_size
                                                   for t, s in zip(tables, spans)]),
                      logits_indices=ends.astype(np.int64))


def time_shapes(engine, vocab: int, repeat: int = 1) -> dict[str, float]:
    """ms per shape: the fastest of `repeat` runs (a shared machine's load only ever adds time)."""
    out = {}
    for name, seqs in SHAPES.items():
        batch = paged_batch(seqs, engine.kv_layout.block_size, vocab)
        runs = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            engine.execute(batch)
            runs.append((time.perf_counter() - t0) * 1e3)
        out[name] = min(runs)
    return out


def profile_decode(artifact: str, threads: int, batch_size: int, out_dir: Path) -> dict[str, float]:
    """ms per op type over 20 decode steps of batch_size sequences at past 300 (decode engine)."""
    art = EngineArtifact.load(artifact)
    engine = load_engine(art, threads)
    engine.allocate_kv(batch_size * 20 + 8)
    opts = session_options(threads, ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    opts.enable_profiling, opts.profile_file_prefix = True, str(out_dir / Path(artifact).name)
    session = cpu_session(str(art.path / art.manifest.engines[0]["file"]), opts)
    engine.sessions = [(0, session)]
    batch = paged_batch([(300, 1)] * batch_size, engine.kv_layout.block_size, art.manifest.spec.vocab_size)
    for _ in range(20):
        engine.execute(batch)
    events = json.loads(Path(session.end_profiling()).read_text())
    by_op = defaultdict(float)
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            by_op[e["args"]["op_name"]] += e["dur"] / 1e3 / 20
    return dict(sorted(by_op.items(), key=lambda kv: -kv[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts", nargs="+")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=3, help="runs of each shape per round; the fastest counts")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", type=Path, default=None, help="folder for ORT per-op profiles of a decode step")
    args = ap.parse_args()
    engines, vocab = {}, EngineArtifact.load(args.artifacts[0]).manifest.spec.vocab_size
    for a in args.artifacts:
        engines[a] = load_engine(EngineArtifact.load(a), args.threads)
        engines[a].allocate_kv(640)                          # decode x32 at past 300 reads 608 blocks
        time_shapes(engines[a], vocab)                       # warm-up
    times = defaultdict(lambda: defaultdict(list))
    for _ in range(args.rounds):
        for a, engine in engines.items():
            for name, ms in time_shapes(engine, vocab, args.repeat).items():
                times[a][name].append(ms)
    base = args.artifacts[0]
    print("| shape | " + " | ".join(args.artifacts) + " |\n|---|" + "---|" * len(args.artifacts))
    for name in SHAPES:
        ref = np.median(times[base][name])
        cells = [f"{np.median(times[a][name]):.1f} ms ({ref / np.median(times[a][name]):.2f}×)" for a in args.artifacts]
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
        for batch_size in (1, 32):
            for a in args.artifacts:
                ops = profile_decode(a, args.threads, batch_size, args.profile)
                top = ", ".join(f"{op} {ms:.2f}" for op, ms in list(ops.items())[:10])
                print(f"decode x{batch_size} {a}: total {sum(ops.values()):.2f} ms in kernels; {top}")


if __name__ == "__main__":
    main()
