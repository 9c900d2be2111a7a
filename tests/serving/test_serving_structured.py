"""Structured output through the real server and the official openai client: JSON Schemas,
JSON mode, vLLM's guided_* fields, and the 400s for what cannot be used. A grammar forces
validity whatever the weights, so the tiny random-weight model is a fair test: every reply must
parse and validate, greedy and sampled, streamed and whole."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

MODEL = "tiny-llama-none"

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 10},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "scores": {"type": "array", "items": {"type": "number", "minimum": -1, "maximum": 1},
                   "minItems": 1, "maxItems": 4},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "address", "scores", "active"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object",
            "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                           "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "qty"], "additionalProperties": False}},
        "priority": {"enum": ["low", "high"]},
        "note": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 8}]},
    },
    "required": ["items", "priority", "note"],
    "additionalProperties": False,
}
SCHEMAS = {"person": PERSON, "order": ORDER}


@pytest.fixture(scope="module")
def client(tiny_server):
    return openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused", max_retries=0)


def _chat(client, stream: bool, **kw) -> tuple[str, str]:
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "Describe someone."}], "max_tokens": 400, **kw}
    if not stream:
        out = client.chat.completions.create(**kw)
        return out.choices[0].message.content, out.choices[0].finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=7),
                                      dict(temperature=1.3, top_p=0.9, seed=11)], ids=["greedy", "sampled", "nucleus"])
@pytest.mark.parametrize("name", SCHEMAS)
def test_json_schema_replies_validate(client, name, sampling, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}
    text, finish = _chat(client, stream, response_format=fmt, **sampling)
    assert finish == "stop", text
    jsonschema.validate(json.loads(text), SCHEMAS[name])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_json_mode_is_an_object(client, stream):
    text, finish = _chat(client, stream, response_format={"type": "json_object"}, temperature=0)
    assert finish == "stop" and isinstance(json.loads(text), dict), text


def test_response_format_text_is_free_text(client):
    text, finish = _chat(client, False, response_format={"type": "text"}, temperature=0, max_tokens=5)
    assert finish == "length" and text


def test_guided_regex_and_choice_on_completions(client):
    out = client.completions.create(model=MODEL, prompt="Code:", max_tokens=40, temperature=0,
                                    extra_body={"guided_regex": r"[A-Z]{3}-[0-9]{4}"})
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{4}", out.choices[0].text) and out.choices[0].finish_reason == "stop"
    for seed in range(3):
        out = client.completions.create(model=MODEL, prompt="Pick:", max_tokens=10, temperature=1.0, seed=seed,
                                        extra_body={"guided_choice": ["red", "green", "blue"]})
        assert out.choices[0].text in ("red", "green", "blue")


def test_guided_grammar_and_json(client):
    grammar = 'start: "(" num ("," num)* ")"\nnum: /[0-9]{1,2}/'
    out = client.completions.create(model=MODEL, prompt="Tuple:", max_tokens=60, temperature=0,
                                    extra_body={"guided_grammar": grammar})
    assert re.fullmatch(r"\(\d{1,2}(,\d{1,2})*\)", out.choices[0].text), out.choices[0].text
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=200,
                                         temperature=0, extra_body={"guided_json": ORDER})
    jsonschema.validate(json.loads(out.choices[0].message.content), ORDER)


def test_cut_by_max_tokens_finishes_with_length(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    text, finish = _chat(client, False, response_format=fmt, temperature=0, max_tokens=5)
    assert finish == "length"
    with pytest.raises(ValueError):
        json.loads(text)


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "response_format"),
    ({"guided_json": {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(4000)}}},
     "guided_json"),                                                            # over 64 KiB to compile
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),     # the template has no tools
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_unusable_constraints_are_400(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=5,
                                       extra_body=extra)
    assert e.value.body["param"] == param, e.value.body
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3)
    assert out.choices[0].finish_reason in ("stop", "length")


def test_the_openai_clients_pydantic_parse(client):
    from typing import Literal

    from pydantic import BaseModel, Field

    class Item(BaseModel):
        sku: str = Field(pattern=r"^[A-Z]{3}-[0-9]{2}$")
        qty: int = Field(ge=1, le=9)

    class Order(BaseModel):
        items: list[Item] = Field(min_length=1, max_length=3)
        priority: Literal["low", "high"]

    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    out = parse(model=MODEL, messages=[{"role": "user", "content": "An order."}], response_format=Order,
                max_tokens=300, temperature=0)
    order = out.choices[0].message.parsed
    assert isinstance(order, Order) and 1 <= len(order.items) <= 3
