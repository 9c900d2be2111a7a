"""tritonserver serving the SmolLM2 int4 artifact: streamed greedy text equals LLM.generate, alone
and with concurrent streams batched together."""

from __future__ import annotations

import pytest

from kiln import LLM, RuntimeConfig, SamplingParams

from triton_client import scrape, text_of, token_ids_of, wait_for
from token_agreement import QUANT_GAP, TOP_K, assert_outputs_close

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
GREEDY = dict(max_tokens=32, temperature=0.0)


@pytest.fixture(scope="module")
def expected(smollm2_int4_artifact):
    """Generated together, with top-k logprobs: the server's replies (batched otherwise, and without
    logprobs) agree up to the first near-tie, which the reference's top-k judges (int4 weights)."""
    llm = LLM(smollm2_int4_artifact, RuntimeConfig(kv_cache_memory=256 << 20))
    return llm.generate(PROMPTS, SamplingParams(**GREEDY, logprobs=TOP_K))


def test_streamed_greedy_equals_generate(open_stream, smollm2_server, expected):
    stream = open_stream(smollm2_server)
    stream.send("alone", PROMPTS[0], stream=True, **GREEDY)
    responses = stream.collect(1, timeout=120)["alone"]
    stream.close()
    assert len(responses) > 1
    if assert_outputs_close(token_ids_of(responses), expected[0], max_gap=QUANT_GAP,
                            names=("served", "generated")) is None:
        assert text_of(responses) == expected[0].text
    assert "Paris" in text_of(responses)


def test_concurrent_streams_batched_and_equal(open_stream, smollm2_server, expected):
    stream = open_stream(smollm2_server)
    for i, prompt in enumerate(PROMPTS):
        stream.send(str(i), prompt, stream=True, **GREEDY)
    responses = stream.collect(len(PROMPTS), timeout=120)
    stream.close()
    for i, e in enumerate(expected):
        served = responses[str(i)]
        if assert_outputs_close(token_ids_of(served), e, max_gap=QUANT_GAP, names=(f"served {i}", "generated")) is None:
            assert text_of(served) == e.text
    assert max(int(r.as_numpy("batch_size")[0]) for rs in responses.values() for r in rs) > 1
    wait_for(lambda: scrape(smollm2_server)["kiln_kv_blocks_used"] == 0)
