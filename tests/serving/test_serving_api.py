"""The OpenAI API on the tiny model, through the official `openai` client."""

from __future__ import annotations

import httpx
import openai
import pytest


@pytest.fixture(scope="module")
def client(tiny_server):
    return openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def _model(client) -> str:
    return client.models.list().data[0].id


def test_health_ready_and_models(tiny_server, client):
    assert httpx.get(f"{tiny_server.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{tiny_server.url}/ready").status_code == 200
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny-llama-none"]


def test_completion(client):
    out = client.completions.create(model=_model(client), prompt="Hello there", max_tokens=8,
                                    temperature=0, extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert choice.finish_reason == "length" and choice.text
    assert out.usage.completion_tokens == 8
    assert out.usage.prompt_tokens == len("Hello there")          # byte-level tokenizer, no BOS
    assert out.usage.total_tokens == out.usage.prompt_tokens + 8
    assert out.usage.prompt_tokens_details.cached_tokens == 0


def test_completion_stream_matches_whole(client):
    kw = dict(model=_model(client), prompt="Once upon a time", max_tokens=12, temperature=0.7, seed=5,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_chat(client):
    out = client.chat.completions.create(model=_model(client), max_tokens=6, temperature=0,
                                         messages=[{"role": "system", "content": "Be brief."},
                                                   {"role": "user", "content": "Hi!"}])
    msg = out.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str)
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.usage.prompt_tokens > len("Be brief.Hi!")            # the chat template's markup


def test_chat_stream_with_usage(client):
    stream = client.chat.completions.create(model=_model(client), max_completion_tokens=10, temperature=0,
                                            messages=[{"role": "user", "content": "Tell me a story"}],
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    usage = chunks[-1].usage
    assert usage.completion_tokens == 10 and usage.total_tokens == usage.prompt_tokens + 10


def test_logprobs(client):
    out = client.completions.create(model=_model(client), prompt="abc", max_tokens=4, temperature=0,
                                    logprobs=3, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    # A dict keyed by text: byte tokens that all decode to U+FFFD collapse into one key.
    assert len(lp.tokens) == 4 and all(1 <= len(top) <= 3 for top in lp.top_logprobs)
    assert all(x <= 0 for x in lp.token_logprobs)
    chat = client.chat.completions.create(model=_model(client), max_tokens=3, temperature=0, logprobs=True,
                                          top_logprobs=2, messages=[{"role": "user", "content": "x"}],
                                          extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)


def test_sampling_knobs_accepted(client):
    out = client.completions.create(
        model=_model(client), prompt="The", max_tokens=5, temperature=0.8, top_p=0.9, seed=3,
        presence_penalty=0.5, frequency_penalty=0.2, stop=["zz"],
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True})
    assert out.choices[0].finish_reason in ("stop", "length")
