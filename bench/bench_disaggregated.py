"""Disaggregated prefill/decode (kiln/runtime/disagg) against the colocated runtime, on an ort
artifact: the KV handover's cost per token, and the running streams' inter-token latency while
long prompts arrive.

    kiln build smollm2-135m --out engines/smollm2-ort --backend ort --quant int8
    .venv/bin/python -m bench.bench_disaggregated engines/smollm2-ort

Streams: --streams short prompts decoding --stream-tokens tokens each; meanwhile a --long-tokens
prompt arrives every --every seconds (--long-prompts of them, 2 reply tokens each). Each side
gets the same requests. NOTE: on a 2-core machine the two workers share the cores, so the
prefill worker's compute still slows the decode worker's steps; the figure shows whether decode
steps stop carrying prefill chunks, not what a separate prefill machine gives.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

import numpy as np

from kiln import LLM, RuntimeConfig, SamplingParams
from kiln.runtime.disagg.coordinator import DisaggregatedLLM
from kiln.runtime.disagg.handover import discard, export_blocks, import_blocks
from kiln.runtime.sinks import CompletionSink


def prompts(args, vocab: int):
    rng = np.random.default_rng(0)
    streams = [rng.integers(100, vocab, 24).tolist() for _ in range(args.streams)]
    longs = [rng.integers(100, vocab, args.long_tokens).tolist() for _ in range(args.long_prompts)]
    return streams, longs


def transfer_cost(llm: LLM, prompt: list[int], repeats: int = 5) -> str:
    """Export a prefilled prompt's blocks to shared memory and import them back, timed."""
    core = llm.core
    request = llm.make_request(prompt, SamplingParams(max_tokens=2, temperature=0))
    core.add_request(request)
    while request.num_output_tokens == 0:
        core.step()
    blocks = core.kv.block_table(request.request_id)[:-(-len(prompt) // core.kv.block_size)]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        handover = export_blocks(core.engine, blocks, request.request_id, prompt, request.output_token_ids[0])
        import_blocks(core.engine, blocks, handover)
        times.append(time.perf_counter() - t0)
        discard(handover)
    core.abort(request.request_id)
    seconds = statistics.median(times)
    nbytes = int(np.prod(handover.shape)) * np.dtype(handover.dtype).itemsize
    return (f"handover of a {len(prompt)}-token prompt: {nbytes / 2**20:.1f} MiB ({len(blocks)} blocks), "
            f"export + import {seconds * 1e3:.1f} ms = {seconds / len(prompt) * 1e6:.1f} us/token (median of {repeats})")


def itl_figures(times_per_stream: list[list[float]]) -> str:
    gaps = [b - a for times in times_per_stream for a, b in zip(times, times[1:])]
    return f"ITL p50 {np.percentile(gaps, 50) * 1e3:.0f} ms, p99 {np.percentile(gaps, 99) * 1e3:.0f} ms " \
           f"({len(gaps)} gaps)"


def colocated(llm: LLM, streams, longs, args) -> str:
    stream_params = SamplingParams(max_tokens=args.stream_tokens, temperature=0, ignore_eos=True)
    requests = [llm.make_request(p, stream_params) for p in streams]
    sinks = [CompletionSink(r, llm.outputs) for r in requests]
    llm.client.submit_all(list(zip(requests, sinks)))

    def arrivals():
        for p in longs:
            time.sleep(args.every)
            llm.generate([p], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    thread = threading.Thread(target=arrivals)
    thread.start()
    for sink in sinks:
        sink.result()
    thread.join()
    return itl_figures([r.timings.token_times for r in requests])


def disaggregated(disagg: DisaggregatedLLM, streams, longs, args) -> str:
    stream_params = SamplingParams(max_tokens=args.stream_tokens, temperature=0, ignore_eos=True)
    ids = [disagg.submit(p, stream_params) for p in streams]
    pending, next_at = list(longs), time.monotonic() + args.every
    long_ids = []
    while not all(r in disagg.results for r in ids + long_ids) or pending:
        if pending and time.monotonic() >= next_at:
            long_ids.append(disagg.submit(pending.pop(0), SamplingParams(max_tokens=2, temperature=0,
                                                                          ignore_eos=True)))
            next_at += args.every
        try:
            disagg._pump(0.02)
        except TimeoutError:
            pass
    times = [disagg.token_times[r] for r in ids]
    disagg.wait(ids + long_ids)
    return itl_figures(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--streams", type=int, default=3)
    ap.add_argument("--stream-tokens", type=int, default=150)
    ap.add_argument("--long-tokens", type=int, default=1000)
    ap.add_argument("--long-prompts", type=int, default=4)
    ap.add_argument("--every", type=float, default=1.5)
    ap.add_argument("--threads", type=int, default=1, help="engine threads per worker (and colocated)")
    args = ap.parse_args()
    config = RuntimeConfig(kv_cache_memory=256 << 20, threads=args.threads)
    llm = LLM(args.artifact, config)
    streams, longs = prompts(args, llm.artifact.manifest.spec.vocab_size)
    print(transfer_cost(llm, longs[0]))
    print(f"colocated:     {colocated(llm, streams, longs, args)}")
    llm.shutdown()
    disagg = DisaggregatedLLM(args.artifact, config)
    try:
        print(f"disaggregated: {disaggregated(disagg, streams, longs, args)}")
    finally:
        disagg.shutdown()


if __name__ == "__main__":
    main()
