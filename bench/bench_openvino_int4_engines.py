"""Same-run CPU time of openvino artifacts' engine calls (bench_openvino_calls.py's variants and
shapes), timed by the process's CPU time on one thread: a figure the shared machine's other jobs
disturb far less than wall time. How the openvino int4 weight forms were compared on the whole model.

    .venv/bin/python -m bench.bench_openvino_int4_engines A B "B@inference_precision=bf16" --shapes 1,64,1 1,0,512
"""

from __future__ import annotations

import argparse
import statistics
import time


from bench.bench_openvino_calls import batch_for, bind_caches, compile_variant, parse_shape
from kiln.engines.openvino.engine import _block_shape, cache_inputs
from kiln.engines.openvino.feeds import paged_feeds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--shapes", nargs="+", default=["1,64,1", "1,300,1", "1,0,512"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--calls", type=int, default=60, help="timed calls per variant for a decode (prefills: a tenth)")
    args = ap.parse_args()
    clock = time.process_time if args.threads == 1 else time.perf_counter
    compiled = {v: compile_variant(v, args.threads) for v in args.variants}
    print(f"{args.threads} thread(s), {'CPU' if args.threads == 1 else 'wall'} time per call")
    for shape in args.shapes:
        groups = parse_shape(shape)
        runs = {}
        for variant, model in compiled.items():
            block_size = _block_shape(cache_inputs(model)[1])[1]
            batch, num_blocks = batch_for(groups, block_size)
            request, keep, _ = bind_caches(model, num_blocks)
            runs[variant] = (request, keep, paged_feeds(batch, block_size, num_blocks), [])
        tokens = sum(b * t for b, _, t in groups)
        for _ in range(2 + (max(3, args.calls // 10) if tokens > 64 else args.calls)):
            for request, _, feeds, times in runs.values():
                t0 = clock()
                request.infer(feeds, share_inputs=True)
                times.append(clock() - t0)
        base = statistics.median(runs[args.variants[0]][3][2:])
        for variant, (*_, times) in runs.items():
            median, low = statistics.median(times[2:]), min(times[2:])
            print(f"{shape:>12}  {median * 1e3:8.2f} ms  {median / base:5.3f}x  (min {low * 1e3:8.2f})  {variant}")


if __name__ == "__main__":
    main()
