"""bench/bench_runtime.py's report: per-system medians, the issue's target rows, the agreement line.

Made-up worker results (no model): the arithmetic that decides "met" or "missed" is what is tested.
"""

import pytest

runtime_report = pytest.importorskip("bench.runtime_report")

EOS = 2


class FakeTokenizer:
    eos_token_id = EOS

    def decode(self, ids):
        return " ".join({7: runtime_report.ANSWER, 8: "Lyon"}.get(i, "x") for i in ids)


def run(first, total, tokens, **extra):
    return {"first_token_s": first, "total_s": total, "token_ids": tokens, **extra}


def result(system, ttft_s, single_s, way32_s, answer, decode=None):
    """single stream: 5 tokens after the first in single_s - 0.1 s; 32-way: 32 x 4 tokens in way32_s."""
    way = run(0.1, way32_s, [[1] * 4] * 32, **({"decode": decode} if decode else {}))
    return {"system": system, "name": system.replace(":", " "), "setup_s": 1.0, "runs": {
        "ttft": [run(ttft_s, ttft_s, [[1]])],
        "single": [run(0.1, single_s, [[1, 2, 3, 4, 5, 6]])],
        "8-way": [run(0.1, 1.0, [[1] * 4] * 8)],
        "32-way": [way],
        "chat": [run(0.1, 0.2, [[9, 7, EOS, 8]])] if answer else [run(0.1, 0.2, [[9, 8, EOS, 7]])]}}


def test_targets_met_and_missed_from_ratios():
    tok = FakeTokenizer()
    decode = {"steps": 10, "wall_s": 1.0, "core_s": 0.95, "engine_s": 0.9}
    results = [result("kiln:ort:int8", 0.3, 1.1, 2.0, True, decode),      # TTFT 300 ms, 5 tok/s, 64 tok/s
               result("kiln:ort:int4", 0.5, 0.6, 2.0, False),             # 10 tok/s
               result("openvino:int8", 0.4, 1.1, 1.0, True),              # 32-way 128 tok/s
               result("genai:int4", 0.5, 1.1, 1.0, True)]                 # 5 tok/s
    summaries = [runtime_report.summarize(r, tok) for r in results]
    assert summaries[0].metrics["ttft_ms"] == pytest.approx(300)
    assert summaries[0].metrics["1-stream"] == pytest.approx(5.0)
    assert summaries[0].overhead_pct == pytest.approx(10.0)
    assert summaries[0].chat == "x " + runtime_report.ANSWER                # cut at EOS
    rows = {(r.kiln_name, r.metric, r.peer_name): r for r in runtime_report.target_rows(summaries)}
    assert rows[("kiln ort int8", "TTFT 512", "openvino int8")].met is True          # 0.75x <= 1.0x
    assert rows[("kiln ort int8", "1 stream", "openvino int8")].met is True          # 1.0x >= 1.0x
    assert rows[("kiln ort int8", "32-way", "openvino int8")].met is False           # 0.5x < 1.5x
    assert rows[("kiln ort int4", "1 stream", "genai int4")].ratio == pytest.approx(2.0)
    assert rows[("kiln ort int4", f"chat answer names {runtime_report.ANSWER}", "")].met is False
    assert rows[("kiln ort int8", "Python overhead / decode step, B=32", "")].met is True


def test_missing_peer_is_not_measured_and_failed_system_is_kept():
    tok = FakeTokenizer()
    summaries = [runtime_report.summarize(result("kiln:ort:int8", 0.3, 1.1, 2.0, True), tok),
                 runtime_report.summarize({"system": "openvino:int8", "error": "worker exited 1"}, tok)]
    ttft = next(r for r in runtime_report.target_rows(summaries) if r.metric == "TTFT 512")
    assert ttft.met is None and ttft.ratio is None
    assert summaries[1].error == "worker exited 1"


def test_agreement_counts_shared_greedy_prefix_against_kiln_fp32():
    tok = FakeTokenizer()
    a = result("kiln:ort:fp32", 0.3, 1.1, 2.0, True)
    b = result("genai:fp32", 0.3, 1.1, 2.0, True)
    b["runs"]["single"][0]["token_ids"] = [[1, 2, 3, 9, 9, 9]]
    same = runtime_report.agreement([runtime_report.summarize(b, tok), runtime_report.summarize(a, tok)])
    assert list(same) == ["kiln ort fp32", "genai fp32"]                 # the reference first
    assert same["genai fp32"] == 3


def test_rounds_pool_their_repetitions_and_a_failed_round_fails_the_system():
    bench_runtime = pytest.importorskip("bench.bench_runtime")
    tok = FakeTokenizer()
    slow, fast = result("kiln:ort:int8", 0.3, 1.1, 2.0, True), result("kiln:ort:int8", 0.1, 0.6, 1.0, True)
    merged = bench_runtime.merge_rounds([slow, fast, fast])
    assert len(merged["runs"]["32-way"]) == 3 and len(slow["runs"]["32-way"]) == 1    # inputs untouched
    assert runtime_report.summarize(merged, tok).metrics["ttft_ms"] == pytest.approx(100)   # median of 300, 100, 100
    failed = {"system": "kiln:ort:int8", "error": "worker exited 1"}
    assert bench_runtime.merge_rounds([slow, failed]) is failed
