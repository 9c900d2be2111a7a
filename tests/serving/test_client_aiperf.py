"""NVIDIA's load generator, AIPerf (a client nobody here wrote), against the real `kiln serve` on
SmolLM2 with the server's defaults, and `kiln bench` on the same requests: the workload's first
requests written by `kiln bench --export-requests` and replayed by AIPerf from that file.

What must hold: AIPerf completes with no client-side error; kiln's `usage` equals AIPerf's own
count of the same text (with --apply-chat-template it counts the prompt as the template renders
it, so the template's tokens are in both); both tools see the same token counts; each tool's
time to first token is at least the server's own (the client's clock holds the server's); and
each tool's inter-token latency agrees with the server's within ITL_AGREEMENT (stated below)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from third_party_clients import client_tool, counter_delta

pytestmark = pytest.mark.slow

KILN = Path(sys.executable).parent / "kiln"
NUM_REQUESTS, CONCURRENCY, MAX_REPLY = 12, 4, 24
# A client's mean gap between a request's tokens against the server's own for the same tokens: the
# stream's two ends are timed a network hop apart, so they agree closely. NOTE: the two tools' own
# figures differ far more: AIPerf's processes take a whole core of the two (50 s of CPU in a 51 s
# run, against 2.6 s for kiln bench), which halves the server's throughput (docs/benchmarks.md).
ITL_AGREEMENT = 1.25


def _server(start_server, artifact):
    """A server of each tool's own: the second on a shared one would find the first's prompts in
    the prefix cache. NOTE: admission by predicted TTFT is off (--ttft-slo 0): this test is about
    what a third-party client reads, and on a slow CPU (AVX2 without VNNI: ~6 ms a prompt token
    while AIPerf takes a core) a 925-token prompt behind others is rightly predicted past 5x the
    objective and refused with 429, which AIPerf counts as a client error. Admission on the server
    defaults is tested in test_admission*.py."""
    return start_server(artifact, "--kv-cache-memory", "256MiB", "--ttft-slo", "0")


@pytest.fixture(scope="module")
def workload(smollm2_int4_artifact, tmp_path_factory) -> tuple[Path, list[dict]]:
    path = tmp_path_factory.mktemp("aiperf-requests") / "requests.jsonl"
    subprocess.run([str(KILN), "bench", "--export-requests", str(path), "--tokenizer", str(smollm2_int4_artifact),
                    "--workload", "chat", "--max-requests", str(NUM_REQUESTS), "--max-tokens", str(MAX_REPLY)],
                   check=True, timeout=120)
    return path, [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def aiperf_run(start_module_server, workload, smollm2_int4_artifact, tmp_path_factory):
    smol = _server(start_module_server, smollm2_int4_artifact)
    out = tmp_path_factory.mktemp("aiperf-out")
    model = httpx.get(f"{smol.url}/v1/models", timeout=10).json()["data"][0]["id"]
    before = smol.metrics()
    cmd = [str(client_tool("aiperf")), "profile", "--model", model, "--url", smol.url, "--endpoint-type", "chat",
           "--streaming", "--tokenizer", str(smollm2_int4_artifact / "tokenizer"), "--apply-chat-template",
           "--input-file", str(workload[0]), "--custom-dataset-type", "single_turn",
           "--dataset-sampling-strategy", "sequential", "--request-count", str(NUM_REQUESTS),
           "--concurrency", str(CONCURRENCY), "--extra-inputs", "ignore_eos:true",
           # the reply's special tokens (an end of turn it runs past) stay in the text AIPerf counts
           "--extra-inputs", "skip_special_tokens:false", "--random-seed", "0",
           "--output-artifact-dir", str(out), "--ui-type", "none", "--no-gpu-telemetry", "--no-server-metrics"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"aiperf exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    after = smol.metrics()
    smol.stop()
    summary = json.loads((out / "profile_export_aiperf.json").read_text(encoding="utf-8"))
    records = [json.loads(line) for line in (out / "profile_export.jsonl").read_text(encoding="utf-8").splitlines()]
    return summary, records, before, after


@pytest.fixture(scope="module")
def kiln_bench_run(start_module_server, aiperf_run, smollm2_int4_artifact, tmp_path_factory):
    smol = _server(start_module_server, smollm2_int4_artifact)
    out = tmp_path_factory.mktemp("kiln-bench") / "bench.json"
    before = smol.metrics()
    subprocess.run([str(KILN), "bench", "--url", smol.url, "--tokenizer", str(smollm2_int4_artifact),
                    "--workload", "chat", "--max-requests", str(NUM_REQUESTS), "--max-tokens", str(MAX_REPLY),
                    "--concurrency", str(CONCURRENCY), "--duration", "600", "--json", str(out)],
                   check=True, timeout=600, capture_output=True)
    after = smol.metrics()
    smol.stop()
    (level,) = json.loads(out.read_text(encoding="utf-8"))["runs"][0]["levels"]
    return level, before, after


def _metric(record: dict, name: str):
    return record["metrics"][name]["value"]


def test_aiperf_completes_every_request_without_a_client_error(aiperf_run):
    summary, records, _, _ = aiperf_run
    assert summary["error_summary"] == [] and summary["is_complete"] and not summary["was_cancelled"]
    assert summary["request_count"]["avg"] == NUM_REQUESTS == len(records)
    assert all("error" not in r or r["error"] is None for r in records)


def test_usage_equals_aiperf_s_own_count_of_the_same_text(aiperf_run, workload):
    """The issue's warning (usage off by > 10 % for every request) was AIPerf counting the user
    text alone while usage counts what the model read, template included; counted alike, prompts
    are equal token for token. Replies: usage counts the tokens generated (exactly the length
    asked for, as ignore_eos asks); AIPerf re-tokenizes their text, within its 10 % warning."""
    _, records, before, after = aiperf_run
    for r in records:
        assert _metric(r, "usage_prompt_tokens") == _metric(r, "input_sequence_length")
        assert abs(_metric(r, "usage_completion_tokens_diff_pct")) <= 10
    assert sorted(_metric(r, "usage_completion_tokens") for r in records) == \
        sorted(line["output_length"] for line in workload[1])
    # ... and the server's own counters saw the same totals.
    assert counter_delta(before, after, "kiln_prompt_tokens_total") == \
        sum(_metric(r, "usage_prompt_tokens") for r in records)
    assert counter_delta(before, after, "kiln_generation_tokens_total") == \
        sum(_metric(r, "usage_completion_tokens") for r in records)


def test_kiln_bench_ran_the_requests_aiperf_replayed(kiln_bench_run, workload, aiperf_run):
    level = kiln_bench_run[0]
    records = sorted(level["requests"], key=lambda r: r["index"])
    assert [r["outcome"] for r in records] == ["ok"] * NUM_REQUESTS
    assert [r["output_tokens"] for r in records] == [line["output_length"] for line in workload[1]]
    # usage, as both read it (AIPerf's own total re-tokenizes the text: off by a token or two
    # where the sampled tokens are not the text's canonical tokenization)
    assert level["stats"]["output_tokens"] == sum(_metric(r, "usage_completion_tokens") for r in aiperf_run[1])


def _server_mean(before: dict, after: dict, histogram: str) -> float:
    return counter_delta(before, after, f"{histogram}_sum") / counter_delta(before, after, f"{histogram}_count")


def test_each_tool_s_first_token_time_holds_the_server_s(aiperf_run, kiln_bench_run):
    summary, _, before, after = aiperf_run
    assert summary["time_to_first_token"]["avg"] / 1000 >= _server_mean(before, after, "kiln_time_to_first_token_seconds")
    level, before, after = kiln_bench_run
    assert level["stats"]["ttft"]["mean"] >= _server_mean(before, after, "kiln_time_to_first_token_seconds")


def test_each_tool_s_inter_token_latency_agrees_with_the_server_s(aiperf_run, kiln_bench_run):
    """Both tools time the same tokens the server times, each against its own server and run."""
    summary, _, before, after = aiperf_run
    aiperf_ratio = summary["inter_token_latency"]["avg"] / 1000 / \
        _server_mean(before, after, "kiln_inter_token_latency_seconds")
    level, before, after = kiln_bench_run
    bench_ratio = level["stats"]["itl"]["mean"] / _server_mean(before, after, "kiln_inter_token_latency_seconds")
    tool_ratios = {"output tok/s": summary["output_token_throughput"]["avg"] / level["stats"]["output_tokens_per_s"],
                   "ITL mean": summary["inter_token_latency"]["avg"] / 1000 / level["stats"]["itl"]["mean"]}
    print(f"client / server ITL: aiperf {aiperf_ratio:.3f}, kiln bench {bench_ratio:.3f}; aiperf / kiln bench:",
          {k: round(v, 3) for k, v in tool_ratios.items()})
    for ratio in (aiperf_ratio, bench_ratio):
        assert 1 / ITL_AGREEMENT <= ratio <= ITL_AGREEMENT
