"""bench_runtime.py's workloads: sizes, prompts (token ids of real text) and the per-system timer.

Every system gets the same token ids (kiln's tokenization, chat template included), so no peer's
tokenizer enters the comparison. This module imports nothing from kiln: the OpenVINO GenAI peer
runs it in its own environment.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

TEXT = Path(__file__).parent.parent / "tests" / "data" / "perplexity.txt"
# The greedy chat answer's question and the word a faithful answer names. NOTE: not France's capital:
# SmolLM2-135M's fp32 build nearly ties two first tokens of that answer, so any quantized build's
# answer to it is a coin toss; Japan's answer leads clearly at every early token
# (docs/results/2026-12-07-serving-eleventh-round.md has the logprobs). Result files record both.
QUESTION = "What is the capital of Japan?"
ANSWER = "Tokyo"


@dataclass(frozen=True)
class Sizes:
    decode_tokens: int            # new tokens in the single-stream run
    batch_tokens: int             # new tokens per request in the N-way runs
    chat_tokens: int              # new tokens of the greedy chat answer (cut at EOS afterwards)
    reps: int                     # timed repetitions after one warm-up; the median is reported
    prompt: int = 13              # single stream and every N-way request
    ttft_prompt: int = 512
    ways: tuple[int, ...] = (8, 32)


SIZES = {"full": Sizes(decode_tokens=128, batch_tokens=128, chat_tokens=32, reps=3),
         "quick": Sizes(decode_tokens=16, batch_tokens=8, chat_tokens=16, reps=1)}


def make_prompts(tokenizer, s: Sizes) -> dict[str, list[list[int]]]:
    """Workload name -> prompts. N-way prompts are distinct: consecutive, non-overlapping windows.

    NOTE: equal lengths, so onnxruntime-genai's static batch needs no padding."""
    ids = tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
    need = max(max(s.ways) * s.prompt, s.ttft_prompt)
    if len(ids) < need:
        raise ValueError(f"{TEXT} has {len(ids)} tokens; the workloads need {need}")
    prompts = {"ttft": [ids[:s.ttft_prompt]], "single": [ids[:s.prompt]]}
    for n in s.ways:
        prompts[f"{n}-way"] = [ids[i * s.prompt:(i + 1) * s.prompt] for i in range(n)]
    prompts["chat"] = [tokenizer.encode_chat([{"role": "user", "content": QUESTION}])]
    return prompts


def new_tokens(s: Sizes, workload: str) -> int:
    return {"ttft": 1, "single": s.decode_tokens, "chat": s.chat_tokens}.get(workload, s.batch_tokens)


def measure_system(runner, prompts: dict[str, list[list[int]]], s: Sizes) -> dict[str, list[dict]]:
    """Every workload on one system: one warm-up (allocations, shapes, weight prepacking), then
    `reps` timed runs. The chat answer is one run: only its tokens matter."""
    runs = {}
    for workload, batch in prompts.items():
        n, reps = new_tokens(s, workload), (1 if workload == "chat" else s.reps)
        if workload != "chat":
            _say(f"{runner.name}: {workload} warm-up")
            runner.generate(batch, n)
        runs[workload] = []
        for rep in range(reps):
            _say(f"{runner.name}: {workload} {rep + 1}/{reps}")
            runs[workload].append(asdict(runner.generate(batch, n)))
    return runs


def _say(line: str) -> None:
    print(f"  {line}", file=sys.stderr, flush=True)


def median(values) -> float:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")
