"""The engine core teaches the scheduler's step-cost model real step times (tiny model)."""

from __future__ import annotations

import numpy as np

from kiln import LLM, RuntimeConfig, SamplingParams, SchedulerConfig


def test_real_steps_fill_the_cost_model_and_chunks_follow_it(tiny_llama_artifact):
    llm = LLM(tiny_llama_artifact, RuntimeConfig(kv_cache_memory=64 << 20, scheduler=SchedulerConfig(
        target_itl=0.05, min_prefill_chunk=8)))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, n).tolist() for n in (300, 5, 200, 9, 150, 40)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    try:
        llm.generate(prompts[:1], params)                      # idle prefill
        outs = llm.generate(prompts, params)                   # prefills beside decodes
    finally:
        llm.shutdown()
    assert all(len(o.token_ids) == 24 for o in outs)
    model = llm.core.scheduler.step_costs
    costs = model.costs()
    assert 0 in model.fits and any(b > 0 for b, _ in costs.decode_seconds_by_bucket)
    assert 0 < costs.prefill_seconds_per_token < 0.05
    assert all(0 <= s < 1.0 for _, s in costs.decode_seconds_by_bucket)
    assert 8 <= costs.prefill_budget(4) <= SchedulerConfig().max_num_batched_tokens
