"""Same-run A/B of openvino artifacts' engine calls, with the compile options varied: how the
openvino int8 choice in kiln/engines/openvino/options.py was measured.

    .venv/bin/python -m bench.bench_openvino_calls ART_A ART_B "ART_A@kv_cache_precision=f16;inference_precision=f32" \\
        --shapes 1,64,1 32,64,1 1,0,512

Each artifact may carry overrides after `@`: OpenVinoOptions fields (inference_precision,
kv_cache_precision, dynamic_quantization_group_size) and raw CPU plugin properties prefixed with
`+` (`+PERFORMANCE_HINT=THROUGHPUT`); the override `static` compiles the variant once per shape with
every input's shape fixed to that call's (what a static-shape decode bucket would cost, against the
engine's one dynamic-shape model), and `decodes` the copy the engine compiles for a recurring decode
batch size (kiln/engines/openvino/decode_models.py; decode shapes only). A shape B,PAST,T is B sequences of PAST cached tokens taking T
new tokens each (1 = a decode), and shapes joined by `+` share one call (a mixed step: decodes
beside a prefill chunk, `15,300,1+1,300,28`); calls alternate between the variants, the first two of each are
dropped, and the medians of wall and CPU time (all threads) are printed with their ratios to
the first variant's. `--profile` also prints, per variant and shape, where the last call's time
went (the plugin's per-node counters, summed by operation type and kernel). `--written` has a prefill
write every sequence's past tokens first, so decodes read a cache in memory as a server's do.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import replace
from collections import defaultdict
from pathlib import Path

import numpy as np
import openvino as ov

from kiln.contract.artifact import EngineArtifact
from kiln.contract.engine import PagedBatch
from kiln.engines.openvino.decode_models import fixed_decode_shapes
from kiln.engines.openvino.engine import _block_shape, cache_inputs, core_for
from kiln.engines.openvino.feeds import paged_feeds
from kiln.engines.openvino.options import KV_DTYPES, OpenVinoOptions
from kiln.engines.openvino.kiln_attention import with_library_operations
from kiln.engines.openvino.paged_graph import paged_model

OPTION_TYPES = {"dynamic_quantization_group_size": int}
STATIC = "static"
DECODES = "decodes"


def compile_variant(variant: str, threads: int, static_feeds: dict | None = None,
                    profile: bool = False, decodes: int | None = None) -> ov.CompiledModel:
    """static_feeds (for a `static` variant): the call's feeds, whose shapes the inputs are fixed to;
    decodes (for a `decodes` variant): the engine's copy for that many decodes (decode_models.py)."""
    path, _, overrides = variant.partition("@")
    artifact = EngineArtifact.load(path)
    record = artifact.manifest.engines[0]
    pairs = dict(kv.split("=", 1) if "=" in kv else (kv, "") for kv in overrides.split(";") if kv)
    pairs.pop(STATIC, None)
    pairs.pop(DECODES, None)
    options = replace(OpenVinoOptions.from_dict(record["options"]),
                      **{k: OPTION_TYPES.get(k, str)(v) for k, v in pairs.items() if not k.startswith("+")})
    raw = {k[1:]: v for k, v in pairs.items() if k.startswith("+")}
    core = core_for(options)
    model = paged_model(core.read_model(artifact.path / record["file"]), artifact.manifest.spec, options.attention)
    if options.attention:
        model = with_library_operations(core, model)
    if static_feeds is not None:
        model.reshape({name: ov.PartialShape(list(np.shape(value))) for name, value in static_feeds.items()})
    if decodes is not None:
        model.reshape(fixed_decode_shapes(decodes))
    counters = {"PERF_COUNT": "YES"} if profile else {}
    return core.compile_model(model, "CPU", {**options.compile_properties(threads), **raw, **counters})


def is_static(variant: str) -> bool:
    return STATIC in variant.partition("@")[2].split(";")


def is_decode_copy(variant: str) -> bool:
    return DECODES in variant.partition("@")[2].split(";")


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


def _sharing_caches(compiled: ov.CompiledModel, other: ov.CompiledModel, request: ov.InferRequest) -> ov.InferRequest:
    """A request of compiled bound to the caches of other's request (a copy's prefill runs on the dynamic model)."""
    sharing = compiled.create_infer_request()
    for port in cache_inputs(other):
        sharing.set_tensor(port.get_any_name(), request.get_tensor(port.get_any_name()))
    return sharing


def batch_for(groups: list[tuple[int, int, int]], block_size: int, writing_past: bool = False) -> tuple[PagedBatch, int]:
    """One call's batch of (num_seqs, past, new) groups, each sequence on blocks of its own; returns
    it and the blocks it spans. writing_past: the call that writes each sequence's past tokens
    instead (a prefill of them, on the same blocks; sequences without a past take one token)."""
    seqs = [(past, new) for num_seqs, past, new in groups for _ in range(num_seqs)]
    tables, first = [], 0
    for past, new in seqs:
        count = -(-(past + new) // block_size)
        tables.append(np.arange(first, first + count))
        first += count
    if writing_past:
        seqs = [(0, max(past, 1)) for past, _ in seqs]
    slots = np.concatenate([t[np.arange(p, p + n) // block_size] * block_size + np.arange(p, p + n) % block_size
                            for t, (p, n) in zip(tables, seqs)])
    ends = np.cumsum([n for _, n in seqs])
    batch = PagedBatch(input_ids=np.full(int(ends[-1]), 100, np.int64),
                       positions=np.concatenate([np.arange(p, p + n) for p, n in seqs]),
                       query_lens=np.array([n for _, n in seqs]), past_lens=np.array([p for p, _ in seqs]),
                       block_tables=tables, slot_mapping=slots, logits_indices=ends - 1)
    return batch, first


def parse_shape(shape: str) -> list[tuple[int, int, int]]:
    """"B,PAST,T" or groups joined by "+" (a mixed step: "15,300,1+1,300,28")."""
    return [tuple(map(int, group.split(","))) for group in shape.split("+")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--shapes", nargs="+", default=["1,64,1", "8,64,1", "32,64,1", "32,512,1", "1,0,512"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", action="store_true", help="where each variant's last call went, by operation")
    ap.add_argument("--written", action="store_true",
                    help="a prefill writes each sequence's past tokens before the calls are timed (else the caches "
                    "are zeros, read from the kernel's shared zero page: flattering to attention)")
    args = ap.parse_args()
    compiled = {v: compile_variant(v, args.threads, profile=args.profile) for v in args.variants}
    for shape in args.shapes:
        groups = parse_shape(shape)
        runs = {}
        for variant, model in compiled.items():
            block_size = _block_shape(cache_inputs(model)[1])[1]
            batch, num_blocks = batch_for(groups, block_size)
            feeds = paged_feeds(batch, block_size, num_blocks)
            if is_static(variant):
                caches = {port.get_any_name(): np.empty([num_blocks, *_block_shape(port)], np.uint8)
                          for port in cache_inputs(model)}
                t0, rss0 = time.perf_counter(), resident_mb()
                model = compile_variant(variant, args.threads, {**feeds, **caches}, args.profile)
                print(f"{shape:>20}  static compile {time.perf_counter() - t0:.2f} s, "
                      f"resident memory +{resident_mb() - rss0:.0f} MB")
            writer = model
            if is_decode_copy(variant):
                if any(t != 1 for *_, t in groups):
                    raise SystemExit(f"{variant}: a decode copy takes decodes only, not {shape}")
                model = compile_variant(variant, args.threads, profile=args.profile, decodes=int(batch.num_seqs))
            request, keep, _ = bind_caches(model, num_blocks)
            if args.written:        # NOTE: its feeds stay referenced: the request may keep reading them
                writing = paged_feeds(batch_for(groups, block_size, writing_past=True)[0], block_size, num_blocks)
                writes = request if writer is model else _sharing_caches(writer, model, request)
                writes.infer(writing, share_inputs=True)
                keep += [writing, writes]
            runs[variant] = (request, keep, feeds, [])
        tokens = sum(b * t for b, _, t in groups)
        for _ in range(8 if tokens > 64 else 25):
            for request, _, feeds, times in runs.values():
                t0, c0 = time.perf_counter(), time.process_time()
                request.infer(feeds, share_inputs=True)
                times.append((time.perf_counter() - t0, time.process_time() - c0))
        base_wall, base_cpu = _medians(runs[args.variants[0]][3])
        for variant, (*_, times) in runs.items():
            wall, cpu = _medians(times)
            print(f"{shape:>20}  {wall * 1e3:7.1f} ms  {wall / base_wall:5.3f}x  "
                  f"cpu {cpu * 1e3:7.1f} ms  {cpu / base_cpu:5.3f}x  {variant}")
        if args.profile:
            for variant, (request, *_) in runs.items():
                print_profile(request, f"{shape} {variant}")


def print_profile(request: ov.InferRequest, title: str, top: int = 8) -> None:
    """The last call's per-node counters, summed by (operation type, kernel), costliest first."""
    spent: dict[tuple[str, str], float] = defaultdict(float)
    for info in request.profiling_info:
        spent[(info.node_type, info.exec_type)] += info.real_time.total_seconds()
    total = sum(spent.values()) or 1.0
    print(f"  where {title} went ({total * 1e3:.1f} ms counted):")
    for (node_type, exec_type), seconds in sorted(spent.items(), key=lambda kv: -kv[1])[:top]:
        print(f"    {seconds * 1e3:7.2f} ms  {seconds / total:5.1%}  {node_type} ({exec_type})")


def resident_mb() -> float:
    """This process's resident memory (Linux)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _medians(times: list[tuple[float, float]]) -> tuple[float, float]:
    """Median wall and CPU (all threads) seconds, the first two calls dropped. On a shared machine
    the CPU figure is the steadier one."""
    return statistics.median(t[0] for t in times[2:]), statistics.median(t[1] for t in times[2:])


if __name__ == "__main__":
    main()
