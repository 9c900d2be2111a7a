"""Constrained decoding in the runtime, through the Python API on the tiny model: replies that
validate (greedy, seeded, preempted and recomputed), unconstrained neighbours in the same batch
untouched, and the sampler's mask on made-up logits."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from kiln import LLM, RuntimeConfig, SamplingParams, SchedulerConfig
from kiln.runtime.sampler import Sampler, SamplingState
from kiln.runtime.structured import GrammarError, StructuredOutput, compiler_for
from kiln.tokenizer import Tokenizer
from token_agreement import TOP_K, assert_all_close

SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 9999},
    "tags": {"type": "array", "items": {"enum": ["x", "y", "z"]}, "maxItems": 5},
    "child": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}},
    "required": ["id", "tags", "child"], "additionalProperties": False}
FREE = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=TOP_K)


def _json(max_tokens=200, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, structured=StructuredOutput.json_schema(SCHEMA), **kw)


@pytest.fixture(scope="module")
def llm(tiny_llama_artifact):
    llm = LLM(tiny_llama_artifact, RuntimeConfig(kv_cache_memory=64 << 20))
    yield llm
    llm.shutdown()


def test_constrained_replies_validate_greedy_and_seeded(llm):
    prompts = ["a", "hello there", "x" * 30, "{"]
    outs = llm.generate(prompts, [_json(temperature=0), _json(temperature=1.0, seed=1),
                                  _json(temperature=0.7, top_k=20, seed=2), _json(temperature=1.2, min_p=0.05, seed=3)])
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_seeded_constrained_sampling_repeats(llm):
    params = _json(temperature=1.0, seed=42)
    # exact: the same lone 1-token request twice on one engine (no cached block), the same draws
    assert llm.generate(["q"], params)[0].text == llm.generate(["q"], params)[0].text


def test_unconstrained_neighbours_are_unchanged(llm):
    prompts = ["one", "two two", "three three three"]
    alone = llm.generate(prompts, FREE)
    mixed = llm.generate(prompts + ["json please"] * 3, [FREE] * 3 + [_json(temperature=0)] * 3)
    # a batch of six computes the three with other shapes: equal up to a near-tie
    assert_all_close(mixed[:3], alone, names=("mixed", "alone"))
    for out in mixed[3:]:
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_preempted_constrained_request_resumes_its_grammar(tiny_llama_artifact):
    # A pool too small for all four: requests are preempted and recomputed mid-structure.
    llm = LLM(tiny_llama_artifact, RuntimeConfig(kv_cache_memory=64 << 20, max_kv_blocks=12,
                                                 scheduler=SchedulerConfig(max_num_batched_tokens=32)))
    try:
        prompts = [c * 40 for c in "pqrs"]
        outs = llm.generate(prompts, [_json(max_tokens=120, temperature=1.0, seed=s) for s in range(4)])
        assert llm.core.scheduler.num_preemptions > 0
        for out in outs:
            jsonschema.validate(json.loads(out.text), SCHEMA)
    finally:
        llm.shutdown()


def test_regex_and_choice(llm):
    (out,) = llm.generate(["id:"], SamplingParams(max_tokens=40, temperature=0,
                                                  structured=StructuredOutput.regex(r"[a-f0-9]{8}-[xy]")))
    assert re.fullmatch(r"[a-f0-9]{8}-[xy]", out.text)
    (out,) = llm.generate(["?"], SamplingParams(max_tokens=10, temperature=1.0, seed=5,
                                                structured=StructuredOutput.choice(["yes", "no"])))
    assert out.text in ("yes", "no")


# ---- the pieces, on made-up logits ----

def test_the_mask_overrides_logits_and_bias(tiny_llama_artifact, llm):
    tok = llm.tokenizer
    spec = compiler_for(tok, 259, [tok.eos_token_id]).bind(StructuredOutput.choice(["b"]))
    a, b = tok.encode("a")[-1], tok.encode("b")[-1]
    state = SamplingState.from_params(SamplingParams(temperature=0, structured=spec, logit_bias={a: 100}))
    logits = np.zeros((1, 259), np.float32)
    logits[0, a] = 50
    assert Sampler().sample(logits, [state]).token_ids == [b]
    assert logits[0, a] == 50                      # the caller's logits are not modified


def test_constraint_identity_ignores_the_compiled_grammar(llm):
    spec = StructuredOutput.json_schema({"type": "object", "b": 1, "a": 2})
    bound = compiler_for(llm.tokenizer, 259, [0]).bind(spec)
    assert bound == spec and hash(bound) == hash(spec) and bound.compiled is not None
    assert StructuredOutput.json_schema('{"a": 2, "b": 1, "type": "object"}') == spec   # canonical JSON


def test_an_unbound_constraint_is_refused_clearly():
    with pytest.raises(ValueError, match="bound to the tokenizer"):
        SamplingState.from_params(SamplingParams(structured=StructuredOutput.json_object()))


@pytest.mark.parametrize("spec", [StructuredOutput.regex("(unclosed"), StructuredOutput.grammar("start: nowhere"),
                                  StructuredOutput.json_schema({"type": "nonsense"})])
def test_unusable_constraints_raise_grammar_error(llm, spec):
    with pytest.raises(GrammarError):
        compiler_for(llm.tokenizer, 259, [0]).bind(spec)


def test_the_python_api_binds_and_refuses(llm):
    with pytest.raises(GrammarError):
        llm.generate(["x"], SamplingParams(structured=StructuredOutput.regex("[")))
    assert isinstance(llm.tokenizer, Tokenizer)
