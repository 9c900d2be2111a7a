"""Paged attention alone, one layer of SmolLM2's geometry: OpenVINO's PagedAttentionExtension (each
cache precision the plugin offers) against kiln's own operations (kiln.PagedAttentionU8 / F16), in
one run, interleaved.

    .venv/bin/python -m bench.bench_paged_attention                       # 32 x 150, 32 x 1100, 1 x 512
    .venv/bin/python -m bench.bench_paged_attention --shapes 32x1100 --rounds 3

Each shape is B sequences with P cached tokens: a real prefill writes the cache first (a zeroed
cache would be read from the kernel's shared zero page, never from memory), then decode calls of
one token per sequence are timed (the minimum over --calls), and the prefill of B x P tokens again
(the best of two). Prints per-layer microseconds and each system's ratio to the plugin's u8 cache in the
same round; writes bench/results/paged_attention.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import openvino as ov
from openvino import opset13 as ops

from bench.bench_serving import machine

from kiln.engines.openvino import native
from kiln.engines.openvino.engine import _block_shape
from kiln.engines.openvino.kiln_attention import FORMATS, attention_inputs, operation
from kiln.engines.openvino.options import KV_DTYPES
from kiln.engines.openvino.paged_graph import _attention_inputs, paged_attention_op

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64       # SmolLM2-135M
BASELINE = "openvino-u8"
# the plugin's cache precisions (its own compile properties) and kiln's formats
SYSTEMS = {"openvino-u8": {"KV_CACHE_PRECISION": "u8", "KEY_CACHE_QUANT_MODE": "BY_CHANNEL"},
           # the default openvino int8 build's cache (kiln's int8 linears: keys per token)
           "openvino-u8-by-token": {"KV_CACHE_PRECISION": "u8", "KEY_CACHE_QUANT_MODE": "BY_TOKEN"},
           "openvino-f16": {"KV_CACHE_PRECISION": "f16"},
           "kiln-u8": None, "kiln-f16": None}
SEQUENCE_INPUTS = ("past_lens", "subsequence_begins", "block_indices", "block_indices_begins")


def _parameter(name, element_type, shape):
    p = ops.parameter(ov.PartialShape(shape), element_type, name=name)
    p.output(0).get_tensor().set_names({name})
    return p


def compile_layer(system: str, threads: int, tmp: Path) -> ov.CompiledModel:
    q = _parameter("q", ov.Type.f32, [-1, HEADS * HEAD_DIM])
    k, v = (_parameter(n, ov.Type.f32, [-1, KV_HEADS * HEAD_DIM]) for n in "kv")
    seq = {n: _parameter(n, ov.Type.i32, [-1]) for n in SEQUENCE_INPUTS}
    props = {"INFERENCE_NUM_THREADS": threads, "INFERENCE_PRECISION_HINT": "f32"}
    if system in FORMATS:
        fmt = FORMATS[system]
        caches = [_parameter(n, ov.Type.u8, [-1, KV_HEADS, 32, fmt.row_bytes(HEAD_DIM)])
                  for n in ("key_cache", "value_cache")]
        node = operation(fmt, attention_inputs(q, k, v, *caches, seq, HEAD_DIM ** -0.5, 0))
        core = ov.Core()
        core.add_extension(str(native.require()))
        ov.save_model(ov.Model([node.output(0)], [q, k, v, *caches, *seq.values()]), tmp / f"{system}.xml")
        return core.compile_model(core.read_model(tmp / f"{system}.xml"), "CPU", props)
    spec = types.SimpleNamespace(head_dim=HEAD_DIM, num_heads=HEADS, num_kv_heads=KV_HEADS)
    caches = [_parameter(n, ov.Type.dynamic, ov.PartialShape.dynamic(4)) for n in ("key_cache", "value_cache")]
    seq["max_context_len"] = _parameter("max_context_len", ov.Type.i32, [])
    node = paged_attention_op(spec, _attention_inputs(spec, q, k, v, *caches, seq, 0))
    model = ov.Model([node.output(0)], [q, k, v, *caches, *seq.values()])
    return ov.Core().compile_model(model, "CPU", {**props, **SYSTEMS[system]})


class Layer:
    """A compiled layer with caches for B sequences of P + 1 tokens bound."""

    def __init__(self, compiled: ov.CompiledModel, batch: int, past: int, rng):
        self.request, self.batch, self.past, self.rng = compiled.create_infer_request(), batch, past, rng
        ports = {p.get_any_name(): p for p in compiled.inputs}
        self.with_max_len = "max_context_len" in ports
        block = _block_shape(ports["value_cache"])[1]
        self.per_seq = -(-(past + 1) // block)
        self.keep = []
        for name in ("key_cache", "value_cache"):
            shape = [batch * self.per_seq, *_block_shape(ports[name])]
            self.keep.append(np.zeros(shape, KV_DTYPES[ports[name].get_element_type().get_type_name()]))
            self.request.set_tensor(ports[name], ov.Tensor(self.keep[-1], shared_memory=True))

    def feeds(self, past: int, tokens: int) -> dict:
        b, n = self.batch, self.batch * tokens
        f = {"q": self.rng.standard_normal((n, HEADS * HEAD_DIM), np.float32),
             "k": self.rng.standard_normal((n, KV_HEADS * HEAD_DIM), np.float32),
             "v": self.rng.standard_normal((n, KV_HEADS * HEAD_DIM), np.float32),
             "past_lens": np.full(b, past, np.int32),
             "subsequence_begins": (np.arange(b + 1) * tokens).astype(np.int32),
             "block_indices": np.arange(b * self.per_seq, dtype=np.int32),
             "block_indices_begins": (np.arange(b + 1) * self.per_seq).astype(np.int32)}
        if self.with_max_len:
            f["max_context_len"] = np.array(past + tokens, np.int32)
        return f

    def timed(self, feeds: dict) -> float:
        start = time.perf_counter()
        self.request.infer(feeds)
        return time.perf_counter() - start


def measure(system: str, batch: int, past: int, calls: int, threads: int, tmp: Path) -> dict:
    layer = Layer(compile_layer(system, threads, tmp), batch, past, np.random.default_rng(0))
    prefill = layer.feeds(0, past)
    layer.timed(prefill)                      # writes every cached token
    prefill_s = min(layer.timed(prefill) for _ in range(2))     # the same blocks again, warm
    decode = layer.feeds(past, 1)
    for _ in range(3):
        layer.timed(decode)
    return {"decode_us": min(layer.timed(decode) for _ in range(calls)) * 1e6, "prefill_us": prefill_s * 1e6}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="32x150,32x1100,1x512", help="BxP: B sequences of P cached tokens")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--rounds", type=int, default=2, help="each round runs every system once, in turn")
    ap.add_argument("--calls", type=int, default=30, help="decode calls timed per system and round (minimum kept)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "paged_attention.json")
    ap.add_argument("--journal", default=None, help="the docs/results/ entry that tells this run's story "
                    "(bench/render_results.py links it)")
    args = ap.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    rows = []
    tmp = Path(__file__).parent / ".cache" / "paged-attention"
    tmp.mkdir(parents=True, exist_ok=True)
    for shape in args.shapes.split(","):
        batch, past = (int(x) for x in shape.split("x"))
        runs = {s: [] for s in systems}
        for r in range(args.rounds):
            for system in systems if r % 2 == 0 else systems[::-1]:
                runs[system].append(measure(system, batch, past, args.calls, args.threads, tmp))
        for system in systems:
            decode = statistics.median(m["decode_us"] for m in runs[system])
            prefill = statistics.median(m["prefill_us"] for m in runs[system])
            base = runs.get(BASELINE)
            ratio = decode / statistics.median(m["decode_us"] for m in base) if base else float("nan")
            pratio = prefill / statistics.median(m["prefill_us"] for m in base) if base else float("nan")
            rows.append({"shape": shape, "system": system, "decode_us": decode, "prefill_us": prefill,
                         "decode_vs_openvino_u8": ratio, "prefill_vs_openvino_u8": pratio})
            print(f"{shape:>8s}  {system:20s} decode {decode:8.0f} us/layer ({ratio:4.2f}x)   "
                  f"prefill {batch}x{past} {prefill / 1e3:8.1f} ms/layer ({pratio:4.2f}x)")
    now = datetime.now(timezone.utc)
    result = {"date": now.strftime("%Y-%m-%d"), "time_utc": now.strftime("%H:%M"), **machine(),
              "command": " ".join(["python -m bench.bench_paged_attention", *(argv if argv is not None else sys.argv[1:])]),
              "journal": args.journal, "threads": args.threads, "rounds": args.rounds, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
