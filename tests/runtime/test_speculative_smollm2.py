"""Speculative decoding on SmolLM2-135M (fp32): greedy output is the non-speculative one, token for
token up to the first near-tie (verification computes k+1 rows a call where plain decoding computes
one, and no fp32 kernel promises bit-equal rows across shapes: tests/token_agreement.py):
input-grounded and chat prompts in one batch, with and without preemption, and with a request
cancelled mid-way."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln import LLM, RuntimeConfig, SamplingParams, SchedulerConfig
from kiln.config import SpeculativeConfig
from token_agreement import TOP_K, assert_all_close

GREEDY = SamplingParams(max_tokens=48, temperature=0)
# the plain reference is scored; a speculative run cannot be (logprobs decode one token a step)
SCORED = SamplingParams(max_tokens=48, temperature=0, logprobs=TOP_K)
PASSAGE = (Path(__file__).parents[1] / "data" / "perplexity.txt").read_text().split("\n\n")[2]
CONVERSATIONS = [
    [{"role": "user", "content": f"Repeat the following passage exactly:\n\n{PASSAGE}"}],
    [{"role": "user", "content": f"Correct any mistakes in this passage and return it:\n\n{PASSAGE}"}],
    [{"role": "user", "content": "What are some tips for staying productive when working from home?"}],
]


def _llm(artifact, speculative=True, **sched):
    max_blocks = sched.pop("max_kv_blocks", None)
    return LLM(artifact, RuntimeConfig(kv_cache_memory=256 << 20, max_kv_blocks=max_blocks,
                                       scheduler=SchedulerConfig(**sched),
                                       speculative=SpeculativeConfig(max_decodes=8) if speculative else None))


@pytest.fixture(scope="module")
def prompts_and_plain(smollm2_fp32_artifact):
    llm = _llm(smollm2_fp32_artifact, speculative=False)
    prompts = [llm.chat_prompt(c) for c in CONVERSATIONS]
    outs = llm.generate(prompts, SCORED)
    llm.shutdown()
    return prompts, outs


@pytest.mark.parametrize("sched", [dict(), dict(max_kv_blocks=24, max_num_batched_tokens=64)],
                         ids=["batch", "preemption"])
def test_greedy_output_is_the_non_speculative_one(smollm2_fp32_artifact, prompts_and_plain, sched):
    prompts, plain = prompts_and_plain
    llm = _llm(smollm2_fp32_artifact, **dict(sched))
    assert_all_close([o.token_ids for o in llm.generate(prompts, GREEDY)], plain, names=("speculative", "plain"))
    stats = llm.core.speculator.stats
    assert stats.accepted > 48                                  # the passage is copied from the prompt
    assert llm.core.kv.num_free_blocks == llm.core.kv.num_blocks
    if "max_kv_blocks" in sched:
        assert llm.core.scheduler.num_preemptions > 0
    llm.shutdown()


def test_cancelled_request_frees_its_blocks_and_the_others_are_unchanged(smollm2_fp32_artifact, prompts_and_plain):
    prompts, plain = prompts_and_plain
    llm = _llm(smollm2_fp32_artifact)
    requests = [llm.make_request(p, GREEDY, f"r{i}") for i, p in enumerate(prompts)]
    for r in requests:
        llm.core.add_request(r)
        llm.outputs.add(r)
    while llm.core.speculator.stats.accepted == 0:
        for d in llm.core.step():
            llm.outputs.process(d)
    llm.core.abort("r0")
    while llm.core.has_unfinished():
        for d in llm.core.step():
            llm.outputs.process(d)
    assert_all_close([r.output_token_ids for r in requests[1:]], plain[1:], names=("kept", "plain"))
    assert requests[0].finish_reason == "abort"
    assert llm.core.kv.num_free_blocks == llm.core.kv.num_blocks
    llm.shutdown()
