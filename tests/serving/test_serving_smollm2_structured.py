"""Structured output on the real SmolLM2 (int4) through kiln serve and the official openai client:
every reply to the JSON Schemas of the tiny-model tests parses and validates, greedy and sampled,
streamed and whole (issue 14's acceptance check)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from test_serving_structured import SCHEMAS

pytestmark = pytest.mark.slow

QUESTION = {"person": "Describe a fictional employee of a bakery in Lyon, as JSON.",
            "order": "Write a small hardware-store order as JSON."}


@pytest.fixture(scope="module")
def client(start_module_server, smollm2_int4_artifact):
    server = start_module_server(smollm2_int4_artifact, "--kv-cache-memory", "256MiB", "--served-model-name", "smollm2")
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def _reply(client, name: str, stream: bool, **sampling) -> tuple[str, str]:
    kw = dict(model="smollm2", max_tokens=300, messages=[{"role": "user", "content": QUESTION[name]}],
              response_format={"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name]}},
              **sampling)
    if not stream:
        out = client.chat.completions.create(**kw)
        return out.choices[0].message.content, out.choices[0].finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        text += chunk.choices[0].delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    return text, finish


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.8, seed=5)], ids=["greedy", "sampled"])
@pytest.mark.parametrize("name", SCHEMAS)
def test_smollm2_json_schema_replies_validate(client, name, sampling, stream):
    text, finish = _reply(client, name, stream, **sampling)
    assert finish == "stop", text
    jsonschema.validate(json.loads(text), SCHEMAS[name])


def test_smollm2_json_mode_and_no_tools(client):
    out = client.chat.completions.create(model="smollm2", max_tokens=200, temperature=0,
                                         response_format={"type": "json_object"},
                                         messages=[{"role": "user", "content": 'What is the capital of France? Answer as JSON: '
                                                                                '{"capital": "..."}'}])
    assert out.choices[0].finish_reason == "stop", out.choices[0].message.content
    assert isinstance(json.loads(out.choices[0].message.content), dict)
    with pytest.raises(openai.BadRequestError, match="does not support tools"):
        client.chat.completions.create(model="smollm2", max_tokens=5, messages=[{"role": "user", "content": "x"}],
                                       tools=[{"type": "function", "function": {"name": "f"}}])
