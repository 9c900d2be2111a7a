"""Runtime behaviour on a tiny model: batching invariance, chunking, prefix caching, preemption,
cancellation, sampling plumbing. Another batch shape, chunking or a prefix-cache hit computes a
row with other arithmetic (fp32, but no kernel promises bit-equal results across shapes), and the
tiny model's logits are near-uniform, so those comparisons hold up to the first near-tie
(tests/token_agreement.py); the same request alone on the same engine is bit-exact."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kiln import LLM, RuntimeConfig, SamplingParams, SchedulerConfig
from token_agreement import TOP_K, assert_all_close, assert_outputs_close

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=TOP_K)


def _prompts(n=6, seed=0):
    rng = np.random.default_rng(seed)
    lengths = [3, 9, 17, 40, 70, 5, 33, 100][:n]
    return [rng.integers(0, 256, k).tolist() for k in lengths]


def _llm(artifact, **sched):
    max_blocks = sched.pop("max_kv_blocks", None)
    return LLM(artifact, RuntimeConfig(kv_cache_memory=64 << 20, max_kv_blocks=max_blocks,
                                       scheduler=SchedulerConfig(**sched)))


@pytest.fixture(scope="module")
def alone(tiny_llama_artifact):
    llm = _llm(tiny_llama_artifact)
    return [llm.generate([p], GREEDY)[0] for p in _prompts()]


def _all_blocks_free(llm) -> bool:
    stats = llm.core.kv.stats()
    return stats.used == 0 and stats.free == stats.num_blocks


@pytest.mark.parametrize("sched", [
    dict(),                                                   # one batch, default budget
    dict(max_num_batched_tokens=8),                           # heavy chunking
    dict(max_num_seqs=2),                                     # queueing
    dict(max_kv_blocks=9, max_num_batched_tokens=32),         # preemption
])
def test_batched_matches_alone(tiny_llama_artifact, alone, sched):
    llm = _llm(tiny_llama_artifact, **dict(sched))
    outs = llm.generate(_prompts(), GREEDY)
    assert_all_close(outs, alone, names=("batched", "alone"))
    assert all(o.finish_reason == "length" for o in outs)
    assert _all_blocks_free(llm)
    if "max_kv_blocks" in sched:
        assert llm.core.scheduler.num_preemptions > 0


def test_prefix_cache_hits_and_same_output(tiny_llama_artifact):
    llm = _llm(tiny_llama_artifact)
    shared = list(range(40, 90))
    first = llm.generate([shared + [1, 2, 3]], GREEDY)[0]
    second = llm.generate([shared + [1, 2, 3]], GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 48                     # 3 full blocks of 16
    assert_outputs_close(second, first, names=("prefix-cache hit", "miss"))   # the hit prefills 5 tokens, not 53
    assert llm.core.kv.stats().prefix_hits >= 48


def test_too_long_prompt_refused_up_front(tiny_llama_artifact):
    llm = _llm(tiny_llama_artifact)
    with pytest.raises(ValueError, match="max_model_len|context|long"):
        llm.generate([[1] * 5000], GREEDY)
    assert not llm.core.has_unfinished()


def test_seeded_sampling_is_batch_invariant(tiny_llama_artifact):
    llm = _llm(tiny_llama_artifact)
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=123, ignore_eos=True)
    solo = llm.generate([[5, 6, 7]], params)[0].token_ids
    crowd = llm.generate([[9, 9], [5, 6, 7], list(range(30))], params)[1].token_ids
    # Equal unless a seeded draw lands within the logits' fp32 rounding (~1e-6) of a CDF boundary.
    assert solo == crowd


def test_stop_string_is_not_returned(tiny_llama_artifact):
    llm = _llm(tiny_llama_artifact)
    full = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    stop = full.text[3:5]
    assert stop and stop not in full.text[:3]
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[: full.text.index(stop)]      # exact: the same lone 3-token request (no cached block)


def test_stream_concatenates_to_generate(tiny_llama_artifact):
    llm = _llm(tiny_llama_artifact)
    prompt = [10, 20, 30, 40]
    expected = llm.generate([prompt], GREEDY)[0]

    async def collect():
        return [d async for d in llm.stream(prompt, GREEDY)]
    deltas = asyncio.run(collect())
    llm.shutdown()
    # exact: the same lone 4-token request (no cached block) on the same engine, same arithmetic
    assert sum((d.token_ids for d in deltas), []) == expected.token_ids
    assert "".join(d.text for d in deltas) == expected.text
    assert deltas[-1].finished and deltas[-1].finish_reason == "length"


def test_cancel_half_the_batch_frees_blocks_and_keeps_others(tiny_llama_artifact, alone):
    llm = _llm(tiny_llama_artifact)
    prompts = _prompts()
    requests = [llm.make_request(p, GREEDY, f"r{i}") for i, p in enumerate(prompts)]
    for r in requests:
        llm.core.add_request(r)
        llm.outputs.add(r)
    for _ in range(3):                      # everyone is running and holds blocks
        for d in llm.core.step():
            llm.outputs.process(d)
    held = llm.core.kv.stats().used
    cancelled = requests[::2]
    for r in cancelled:
        llm.core.abort(r.request_id)
    assert llm.core.kv.stats().used < held
    assert all(llm.core.kv.block_table(r.request_id) == [] for r in cancelled)
    while llm.core.has_unfinished():
        for d in llm.core.step():
            llm.outputs.process(d)
    assert_all_close([llm.outputs.result(r) for r in requests[1::2]], alone[1::2], names=("kept", "alone"))
    assert all(r.finish_reason == "abort" for r in cancelled)
    assert _all_blocks_free(llm)


def test_prefill_chunks_grouped_by_length():
    import numpy as np

    from kiln.engines.ort.batching import group_by_length

    lens = np.asarray([500, 20, 22, 480, 21, 19])
    groups = [[int(lens[i]) for i in g] for g in group_by_length(lens)]
    assert groups == [[500, 480], [22, 21, 20, 19]]
