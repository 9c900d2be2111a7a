"""`kiln serve --speculative ngram` on the tiny model: the same greedy text as a plain server (up to
a near-tie: verification computes k+1 rows a call, tests/token_agreement.py), streamed in multi-token chunks by the openai client, and the speculative counters in /metrics;
`kiln generate` takes the flags and refuses a bad method."""

from __future__ import annotations

import subprocess

import openai
import pytest

from kiln_server import KILN
from serving_flags import TINY_FLAGS
from token_agreement import TOP_K, assert_outputs_close

from kiln import LLM, SamplingParams
from kiln.config_options import runtime_config

MODEL = "tiny-llama-none"
PROMPT = "one two three four " * 12


@pytest.fixture(scope="module")
def servers(start_module_server, tiny_llama_artifact):
    plain = start_module_server(tiny_llama_artifact, *TINY_FLAGS)
    spec = start_module_server(tiny_llama_artifact, *TINY_FLAGS, "--speculative", "ngram",
                               "--num-speculative-tokens", "4")
    return plain, spec


def _complete(server, **kw):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=48, temperature=0,
                                     extra_body={"ignore_eos": True}, **kw)


def _assert_same_text_up_to_a_near_tie(artifact, spec_text: str, plain_text: str, *, max_tokens: int,
                                       ignore_eos: bool, num_speculative_tokens: int) -> None:
    """The speculative and the plain path's texts: equal, or parted at a near-tie. A reply carries
    text only (and a request with logprobs would not speculate), so a difference is judged on
    in-process runs of both paths: one lone request each, on the same artifact and knobs as the
    servers (16MiB, one thread), hence the arithmetic each server ran."""
    if spec_text == plain_text:
        return

    def run(**speculative):
        llm = LLM(artifact, runtime_config("16MiB", threads=1, **speculative))
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=ignore_eos,
                                logprobs=None if speculative else TOP_K)
        try:
            return llm.generate([PROMPT], params)[0]
        finally:
            llm.shutdown()
    plain, spec = run(), run(speculative="ngram", num_speculative_tokens=num_speculative_tokens)
    assert spec.text in spec_text and plain.text in plain_text, "the in-process runs are not what was served"
    assert_outputs_close(spec.token_ids, plain, names=("speculative", "plain"))


def test_greedy_text_matches_a_plain_server_and_metrics_count_proposals(servers, tiny_llama_artifact):
    plain, spec = servers
    before = spec.metrics()
    expected = _complete(plain).choices[0].text
    _assert_same_text_up_to_a_near_tie(tiny_llama_artifact, _complete(spec).choices[0].text, expected,
                                       max_tokens=48, ignore_eos=True, num_speculative_tokens=4)
    after = spec.metrics()
    proposed = after["kiln_speculative_proposed_tokens_total"] - before["kiln_speculative_proposed_tokens_total"]
    accepted = after["kiln_speculative_accepted_tokens_total"] - before["kiln_speculative_accepted_tokens_total"]
    assert 0 < accepted <= proposed
    assert after["kiln_speculative_acceptance_rate"] == pytest.approx(
        after["kiln_speculative_accepted_tokens_total"] / after["kiln_speculative_proposed_tokens_total"])
    assert plain.metrics()["kiln_speculative_proposed_tokens_total"] == 0
    assert after["kiln_kv_blocks_used"] == 0


def test_streamed_chunks_concatenate_to_the_same_text(servers, tiny_llama_artifact):
    plain, spec = servers
    expected = _complete(plain).choices[0].text
    chunks = [c.choices[0].text for c in _complete(spec, stream=True) if c.choices]
    _assert_same_text_up_to_a_near_tie(tiny_llama_artifact, "".join(chunks), expected,
                                       max_tokens=48, ignore_eos=True, num_speculative_tokens=4)


def test_generate_takes_the_flags_and_refuses_an_unknown_method(tiny_llama_artifact):
    base = [str(KILN), "generate", str(tiny_llama_artifact), "--prompt", PROMPT, "--max-tokens", "24",
            "--kv-cache-memory", "16MiB", "--threads", "1"]
    plain = subprocess.run(base, capture_output=True, text=True, timeout=120)
    spec = subprocess.run(base + ["--speculative", "ngram", "--num-speculative-tokens", "3"],
                          capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr
    _assert_same_text_up_to_a_near_tie(tiny_llama_artifact, spec.stdout, plain.stdout,
                                       max_tokens=24, ignore_eos=False, num_speculative_tokens=3)
    bad = subprocess.run(base + ["--speculative", "medusa"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "ngram or draft:PATH" in bad.stdout + bad.stderr
