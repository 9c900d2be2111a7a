"""`kiln serve --speculative ngram` on the tiny model: the same greedy text as a plain server,
streamed in multi-token chunks by the openai client, and the speculative counters in /metrics;
`kiln generate` takes the flags and refuses a bad method."""

from __future__ import annotations

import subprocess

import openai
import pytest

from conftest import KILN
from serving_flags import TINY_FLAGS

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


def test_greedy_text_matches_a_plain_server_and_metrics_count_proposals(servers):
    plain, spec = servers
    before = spec.metrics()
    expected = _complete(plain).choices[0].text
    assert _complete(spec).choices[0].text == expected
    after = spec.metrics()
    proposed = after["kiln_speculative_proposed_tokens_total"] - before["kiln_speculative_proposed_tokens_total"]
    accepted = after["kiln_speculative_accepted_tokens_total"] - before["kiln_speculative_accepted_tokens_total"]
    assert 0 < accepted <= proposed
    assert after["kiln_speculative_acceptance_rate"] == pytest.approx(
        after["kiln_speculative_accepted_tokens_total"] / after["kiln_speculative_proposed_tokens_total"])
    assert plain.metrics()["kiln_speculative_proposed_tokens_total"] == 0
    assert after["kiln_kv_blocks_used"] == 0


def test_streamed_chunks_concatenate_to_the_same_text(servers):
    plain, spec = servers
    expected = _complete(plain).choices[0].text
    chunks = [c.choices[0].text for c in _complete(spec, stream=True) if c.choices]
    assert "".join(chunks) == expected


def test_generate_takes_the_flags_and_refuses_an_unknown_method(tiny_llama_artifact):
    base = [str(KILN), "generate", str(tiny_llama_artifact), "--prompt", PROMPT, "--max-tokens", "24",
            "--kv-cache-memory", "16MiB", "--threads", "1"]
    plain = subprocess.run(base, capture_output=True, text=True, timeout=120)
    spec = subprocess.run(base + ["--speculative", "ngram", "--num-speculative-tokens", "3"],
                          capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout
    bad = subprocess.run(base + ["--speculative", "medusa"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "ngram or draft:PATH" in bad.stdout + bad.stderr
