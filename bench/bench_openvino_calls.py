"""Same-run A/B of openvino artifacts' engine calls, with the compile options varied: how the
openvino int8 choice in kiln/engines/openvino/options.py was measured.

    .venv/bin/python bench/bench_openvino_calls.py ART_A ART_B "ART_A@kv_cache_precision=f16;inference_precision=f32" \\
        --shapes 1,64,1 32,64,1 1,0,512

Each artifact may carry overrides after `@`: OpenVinoOptions fields (inference_precision,
kv_cache_precision, dynamic_quantization_group_size) and raw CPU plugin properties prefixed with
`+` (`+PERFORMANCE_HINT=THROUGHPUT`). A shape B,PAST,T is B sequences of PAST cached tokens taking T
new tokens each (1 = a decode); calls alternate between the variants, the first two of each are
dropped, and the median is printed with its ratio to the first variant's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import numpy as np
import openvino as ov

from kiln.artifact import EngineArtifact
from kiln.engines.base import PagedBatch
from kiln.engines.openvino.engine import _block_shape, cache_inputs
from kiln.engines.openvino.feeds import paged_feeds
from kiln.engines.openvino.options import KV_DTYPES, OpenVinoOptions
from kiln.engines.openvino.paged_graph import paged_model

OPTION_TYPES = {"dynamic_quantization_group_size": int}


def compile_variant(variant: str, threads: int) -> ov.CompiledModel:
    path, _, overrides = variant.partition("@")
    artifact = EngineArtifact.load(path)
    record = artifact.manifest.engines[0]
    pairs = dict(kv.split("=", 1) for kv in overrides.split(";") if kv)
    options = replace(OpenVinoOptions.from_dict(record["options"]),
                      **{k: OPTION_TYPES.get(k, str)(v) for k, v in pairs.items() if not k.startswith("+")})
    raw = {k[1:]: v for k, v in pairs.items() if k.startswith("+")}
    core = ov.Core()
    model = paged_model(core.read_model(artifact.path / record["file"]), artifact.manifest.spec)
    return core.compile_model(model, "CPU", {**options.compile_properties(threads), **raw})


def bind_caches(compiled: ov.CompiledModel, num_blocks: int) -> tuple[ov.InferRequest, list, int]:
    """An infer request with zeroed caches of num_blocks blocks; returns it, what keeps the memory, block size."""
    request, keep = compiled.create_infer_request(), []
    for port in cache_inputs(compiled):
        shape, kind = [num_blocks, *_block_shape(port)], port.get_element_type().get_type_name()
        if kind in KV_DTYPES:
            tensor = ov.Tensor(np.zeros(shape, KV_DTYPES[kind]), shared_memory=True)
        else:                           # bf16: numpy has no such type; the plugin allocates it
            tensor = ov.Tensor(port.get_element_type(), shape)
            tensor.data[...] = 0
        request.set_tensor(port, tensor)
        keep.append(tensor)
    return request, keep, _block_shape(cache_inputs(compiled)[1])[1]


def batch_for(num_seqs: int, past: int, new: int, block_size: int) -> PagedBatch:
    per_seq = -(-(past + new) // block_size)
    positions = np.tile(np.arange(past, past + new), num_seqs)
    tables = [np.arange(b * per_seq, (b + 1) * per_seq) for b in range(num_seqs)]
    slots = np.concatenate([t[np.arange(past, past + new) // block_size] * block_size
                            + np.arange(past, past + new) % block_size for t in tables])
    return PagedBatch(input_ids=np.full(num_seqs * new, 100, np.int64), positions=positions,
                      query_lens=np.full(num_seqs, new), past_lens=np.full(num_seqs, past), block_tables=tables,
                      slot_mapping=slots, logits_indices=np.arange(new - 1, num_seqs * new, new))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--shapes", nargs="+", default=["1,64,1", "8,64,1", "32,64,1", "32,512,1", "1,0,512"])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    compiled = {v: compile_variant(v, args.threads) for v in args.variants}
    for shape in args.shapes:
        num_seqs, past, new = map(int, shape.split(","))
        runs = {}
        for variant, model in compiled.items():
            request, keep, block_size = bind_caches(model, num_seqs * (-(-(past + new) // 16)))
            feeds = paged_feeds(batch_for(num_seqs, past, new, block_size), block_size,
                                num_seqs * (-(-(past + new) // 16)))
            runs[variant] = (request, keep, feeds, [])
        for _ in range(8 if new > 64 else 25):
            for request, _, feeds, times in runs.values():
                t0 = time.perf_counter()
                request.infer(feeds, share_inputs=True)
                times.append(time.perf_counter() - t0)
        base = statistics.median(runs[args.variants[0]][3][2:])
        for variant, (*_, times) in runs.items():
            median = statistics.median(times[2:])
            print(f"B={num_seqs:2d} past={past:4d} T={new:4d}  {median * 1e3:7.1f} ms  {median / base:5.3f}x  {variant}")


if __name__ == "__main__":
    main()
