"""The Python API in vLLM's shapes: LLM(model=...), out.outputs[0].text, chat() on one
conversation or many, so code ported from vLLM runs unchanged."""

from __future__ import annotations

import pytest

from kiln import LLM, RuntimeConfig, SamplingParams

GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
CONVERSATION = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def llm(tiny_llama_artifact):
    llm = LLM(model=str(tiny_llama_artifact), config=RuntimeConfig(kv_cache_memory=16 << 20))
    yield llm
    llm.shutdown()


def test_outputs_read_as_vllms(llm):
    out = llm.generate(["hello"], GREEDY)[0]
    seq = out.outputs[0]
    assert len(out.outputs) == 1 and seq.index == 0 and out.finished
    assert (seq.text, seq.token_ids, seq.finish_reason) == (out.text, out.token_ids, "length")
    assert len(seq.token_ids) == 5 and out.prompt_token_ids == llm.tokenizer.encode("hello")


def test_chat_takes_one_conversation_or_many(llm):
    one = llm.chat(CONVERSATION, GREEDY)
    many = llm.chat([CONVERSATION, CONVERSATION + [{"role": "assistant", "content": "yo"}]], GREEDY)
    assert len(one) == 1 and len(many) == 2
    assert one[0].outputs[0].text == many[0].outputs[0].text


def test_the_artifact_is_named_once(tiny_llama_artifact):
    with pytest.raises(TypeError):
        LLM()
    with pytest.raises(TypeError):
        LLM(tiny_llama_artifact, model=tiny_llama_artifact)
