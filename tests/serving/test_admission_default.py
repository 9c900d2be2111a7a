"""The default admission against a standard benchmark's shape: a closed-loop client at
concurrency 8, streamed chat, 200-token prompts and 64-token replies, 48 requests, the official
openai client and no retries (as NVIDIA's AIPerf runs it). With server defaults every request is
served: admission queues a request predicted past the 2 s objective and refuses only past
5 x it or the queue bound (docs/serving.md, Admission control and 429)."""

from __future__ import annotations

from kiln.bench.loadgen import Level, Limits, run_load
from kiln.bench.target_openai import OpenAITarget
from kiln.bench.text import Prompt
from kiln.bench.workloads import Workload, request_specs

CLIENTS, REQUESTS = 8, 48
MODEL = "tiny"
BENCHMARK = Workload("genai-perf-like", "200-token prompts, 64-token replies",
                     lambda rng, ctx, seed: dict(prompt_tokens=200, max_tokens=64))


def _prompt(spec) -> Prompt:
    # 200 distinct words (one byte-level token each plus a space): no two requests share a prefix
    return Prompt(None, " ".join(chr(97 + (spec.text_offset * 7 + i) % 26) for i in range(200 // 2)))


def test_a_closed_loop_benchmark_at_concurrency_8_gets_no_429_with_server_defaults(start_server,
                                                                                  tiny_llama_artifact):
    # No admission flags. Four seats for eight clients: a newcomer's prediction counts the wait for
    # a seat, up to two replies of 64 steps at the target ITL (2.6 s); refusing at the 2 s objective
    # (--ttft-refuse-factor 1, the old default) turned 8 of these 48 away here (2026-12-01).
    server = start_server(tiny_llama_artifact, "--threads", "1", "--max-num-seqs", "4", "--target-itl", "0.02",
                          "--served-model-name", MODEL)
    target = lambda: OpenAITarget(server.url, MODEL, temperature=1.0, ignore_eos=True)    # noqa: E731
    run = run_load(target, request_specs(BENCHMARK, 0, 1024), _prompt, Level(concurrency=CLIENTS),
                   Limits(duration=120.0, timeout=60.0, max_requests=REQUESTS), backoff=lambda record: 0.0)
    print(f"\n{run.summary()}")
    assert len(run.records) == REQUESTS
    assert [r.status for r in run.records] == [200] * REQUESTS
    assert all(r.completion_tokens == 64 for r in run.records)
    assert server.metrics().get('kiln_requests_rejected_total{reason="ttft_slo"}', 0) == 0
