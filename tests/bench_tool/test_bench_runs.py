"""Short real runs of `kiln bench` on the tiny preset: in-process, against `kiln serve`, and side
by side with HF transformers. They check what is produced (JSON, PNGs, outcomes), never a speed."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from click.testing import CliRunner

from kiln.cli import main

PNG = b"\x89PNG\r\n\x1a\n"
TINY_RUNTIME = ["--kv-cache-memory", "16MiB", "--threads", "1"]


def bench(*args: str) -> str:
    result = CliRunner().invoke(main, ["bench", *args])
    assert result.exit_code == 0, result.output + repr(result.exception)
    return result.output


def levels(path) -> list[dict]:
    doc = json.loads(path.read_text())
    assert len(doc["runs"]) == 1
    return doc["runs"][0]["levels"]


def test_engine_sweep_writes_json_and_plots(tiny_llama_artifact, tmp_path):
    out, knee, cdf = tmp_path / "out.json", tmp_path / "knee.png", tmp_path / "cdf.png"
    text = bench("--engine", str(tiny_llama_artifact), "--workload", "cancel", "--concurrency", "1,4",
                 "--duration", "1.5", "--max-tokens", "16", "--slo-ttft", "5", "--slo-itl", "5",
                 "--json", str(out), "--plot", str(knee), "--cdf-plot", str(cdf), *TINY_RUNTIME)
    assert "TTFT" in text and "goodput" in text
    runs = levels(out)
    assert [lv["label"] for lv in runs] == ["c=1", "c=4"]
    for lv in runs:
        stats = lv["stats"]
        assert stats["num_requests"] == len(lv["requests"]) > 0
        assert stats["outcomes"]["error"] == stats["outcomes"]["timeout"] == 0
        assert stats["ttft"]["p99"] > 0 and stats["output_tokens_per_s"] > 0
        assert stats["goodput"] > 0 and lv["server"]["source"] == "engine (sampled)"
        assert lv["client_lag"]["n"] > 0
    assert sum(lv["stats"]["outcomes"]["cancelled"] for lv in runs) > 0
    assert knee.read_bytes()[:8] == PNG and cdf.read_bytes()[:8] == PNG


def test_cancelled_and_timed_out_requests_leave_the_engine_empty(tiny_llama_artifact):
    from kiln import LLM, RuntimeConfig
    from kiln.bench.loadgen import Level, Limits
    from kiln.bench.session import BenchConfig, run_bench
    from kiln.bench.target_engine import EngineTarget

    target = EngineTarget(LLM(tiny_llama_artifact, RuntimeConfig(kv_cache_memory=16 << 20, threads=1)))
    config = BenchConfig("cancel", (Level(concurrency=4),), Limits(duration=1.0, timeout=0.05), max_tokens=64)

    async def go():
        return await run_bench(target, await target.prepare(), config)

    try:
        result = asyncio.run(go())
        outcomes = result.levels[0].stats.outcomes
        assert outcomes["error"] == 0 and outcomes["cancelled"] + outcomes["timeout"] > 0
        core = target.llm.core
        deadline = time.monotonic() + 5
        while core.has_unfinished() and time.monotonic() < deadline:
            time.sleep(0.05)           # the aborts reach the engine thread within a step
        assert not core.has_unfinished()
        assert core.kv.num_free_blocks == core.kv.num_blocks
    finally:
        asyncio.run(target.close())


def test_max_context_requests_fit_the_engine(tiny_llama_artifact, tmp_path):
    out = tmp_path / "out.json"
    bench("--engine", str(tiny_llama_artifact), "--workload", "max-context", "--max-requests", "3",
          "--duration", "30", "--max-tokens", "4", "--json", str(out), *TINY_RUNTIME)
    (lv,) = levels(out)
    assert lv["stats"]["outcomes"]["ok"] == 3
    assert all(r["prompt_tokens"] > 900 for r in lv["requests"])      # of a 1024-token context


def test_a_remote_url_is_refused():
    result = CliRunner().invoke(main, ["bench", "--url", "http://192.0.2.1:8000", "--duration", "1"])
    assert result.exit_code == 1 and "loopback" in result.output


def test_sweep_against_kiln_serve(tiny_serve_url, tiny_llama_artifact, tmp_path):
    out, knee = tmp_path / "serve.json", tmp_path / "knee.png"
    bench("--url", tiny_serve_url, "--workload", "shared-prefix", "--rate", "5,20", "--duration", "1.5",
          "--max-tokens", "16", "--slo-ttft", "5", "--metrics-interval", "0.2", "--json", str(out),
          "--plot", str(knee))
    runs = levels(out)
    assert [lv["label"] for lv in runs] == ["5 req/s", "20 req/s"]
    for lv in runs:
        stats, server = lv["stats"], lv["server"]
        assert stats["num_requests"] > 0 and stats["outcomes"]["ok"] == stats["num_requests"]
        assert all(r["output_tokens"] == 16 for r in lv["requests"])     # usage chunk; ignore_eos
        assert server["source"] == "/metrics" and server["server_ttft_mean"] > 0
        assert server["queue_depth"]["n"] > 0 and server["batch_size"]["n"] > 0
    assert knee.read_bytes()[:8] == PNG


def test_max_context_against_kiln_serve_with_its_tokenizer(tiny_serve_url, tiny_llama_artifact, tmp_path):
    out = tmp_path / "serve.json"
    bench("--url", tiny_serve_url, "--workload", "max-context", "--endpoint", "completions",
          "--max-requests", "2", "--duration", "30", "--max-tokens", "4", "--tokenizer", str(tiny_llama_artifact),
          "--json", str(out))
    doc = json.loads(out.read_text())["runs"][0]
    assert doc["exact_prompt_lengths"] and doc["context_len"] == 1024
    assert doc["levels"][0]["stats"]["outcomes"]["ok"] == 2


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_compare_with_hf_transformers(tiny_llama_artifact, tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "compare.json"
    text = bench("--engine", str(tiny_llama_artifact), "--compare", "--hf-model", "tiny-llama",
                 "--concurrency", "2", "--duration", "1", "--max-tokens", "8", "--temperature", "0",
                 "--json", str(out), *TINY_RUNTIME)
    doc = json.loads(out.read_text())
    assert [r["target"].split()[0] for r in doc["runs"]] == ["kiln", "HF"]
    assert all(r["levels"][0]["stats"]["outcomes"]["ok"] > 0 for r in doc["runs"])
    (ratio,) = doc["ratios"]
    assert ratio["level"] == "c=2" and ratio["out tok/s"] > 0
    assert "ratios" in text
