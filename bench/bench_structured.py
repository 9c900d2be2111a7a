"""Constrained decoding's cost, measured side by side in one run on one artifact (SmolLM2 int4).

Per-token time (wall seconds / generated tokens, over whole batched generate() calls) for
unconstrained and JSON-Schema-constrained requests at 1 and 16 streams, and a mixed batch of 8 + 8
against 16 unconstrained; beside it the sampler's own time per step (where the grammar masks are
computed and applied), which is the overhead without the machine's noise. The schema cannot close
before max_tokens (an array of at least 30 objects), so every request decodes exactly max_tokens
and the batches stay the same size. Cases are interleaved and repeated; medians are printed.

    flock /tmp/kiln-heavy.lock nice -n 10 .venv/bin/python -m bench.bench_structured ARTIFACT
"""

from __future__ import annotations

import argparse
import statistics
import time

from kiln.config import RuntimeConfig
from kiln.runtime.llm import LLM
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.structured import StructuredOutput

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
SCHEMA = {"type": "object", "properties": {"people": {"type": "array", "items": PERSON, "minItems": 30}},
          "required": ["people"], "additionalProperties": False}
PROMPT = [{"role": "user", "content": "List thirty people with their ages, as JSON."}]


class TimedSampler:
    """The runner's sampler, timed: seconds spent sampling (masks included)."""

    def __init__(self, sampler):
        self.sampler, self.seconds = sampler, 0.0

    def sample(self, logits, requests):
        t0 = time.perf_counter()
        try:
            return self.sampler.sample(logits, requests)
        finally:
            self.seconds += time.perf_counter() - t0


def params(constrained: bool, max_tokens: int) -> SamplingParams:
    structured = StructuredOutput.json_schema(SCHEMA) if constrained else None
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=not constrained, structured=structured)


def per_step_ms(llm: LLM, mix: list[bool], max_tokens: int) -> tuple[float, float]:
    """(wall ms, sampler ms) per decode step: each stream gets one token a step."""
    prompt = llm.chat_prompt(PROMPT)
    timed = llm.core.runner.sampler
    sampler_before = timed.seconds
    t0 = time.perf_counter()
    outs = llm.generate([prompt] * len(mix), [params(c, max_tokens) for c in mix])
    seconds = time.perf_counter() - t0
    assert all(o.finish_reason == "length" for o in outs), [o.finish_reason for o in outs]
    steps = max_tokens
    return 1000 * seconds / steps, 1000 * (timed.seconds - sampler_before) / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    llm = LLM(args.artifact, RuntimeConfig())
    llm.core.runner.sampler = TimedSampler(llm.core.runner.sampler)
    cases = {"1 free": [False], "1 json": [True], "16 free": [False] * 16, "16 json": [True] * 16,
             "8 free + 8 json": [False, True] * 8}
    per_step_ms(llm, [False, True] * 8, 8)     # warm-up: engine buckets, the llguidance tokenizer
    runs = {name: [] for name in cases}
    for _ in range(args.repeats):           # interleaved, so drift in machine load hits every case
        for name, mix in cases.items():
            runs[name].append(per_step_ms(llm, mix, args.max_tokens))
    wall = {name: statistics.median(w for w, _ in v) for name, v in runs.items()}
    sampler = {name: statistics.median(s for _, s in v) for name, v in runs.items()}
    print(f"{'case':<18} {'ms/step':>8} {'ratio':>6} {'sampler ms/step':>16} {'sampler share':>14}")
    for name, base in [("1 free", "1 free"), ("1 json", "1 free"), ("16 free", "16 free"),
                       ("16 json", "16 free"), ("8 free + 8 json", "16 free")]:
        print(f"{name:<18} {wall[name]:>8.2f} {wall[name] / wall[base]:>6.3f} {sampler[name]:>16.3f} "
              f"{sampler[name] / wall[name]:>13.1%}")
    llm.shutdown()


if __name__ == "__main__":
    main()
