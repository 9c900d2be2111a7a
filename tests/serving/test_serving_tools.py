"""OpenAI tools on a tiny Qwen2 whose chat template takes tools (Hermes/Qwen2.5 style): a named
or required tool_choice always yields a valid call (the grammar forces it, whatever the random
weights), whole and streamed, through the official openai client; history with tool calls and
tool results renders."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from kiln.compiler.build import build
from kiln.config import BuildConfig
from kiln.compiler.export.presets import write_tiny_checkpoint
from serving_flags import TINY_FLAGS

# A Qwen2.5-style template, written for this test: tools in a system block, calls as
# <tool_call>{json}</tool_call>, tool results as <tool_response> in a user turn.
TOOL_TEMPLATE = """{% if tools %}<|im_start|>system
You can call these functions:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call one as <tool_call>
{"name": <name>, "arguments": <arguments>}
</tool_call><|im_end|>
{% endif %}{% for message in messages %}{% if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{% for call in message.tool_calls %}<tool_call>
{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}
</tool_call>
{% endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "unit", "days"], "additionalProperties": False}}}
LOOKUP = {"type": "function", "function": {
    "name": "lookup", "parameters": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}},
                                     "required": ["id"], "additionalProperties": False}}}
TOOLS = [WEATHER, LOOKUP]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tool_artifact(tmp_path_factory):
    src = write_tiny_checkpoint("tiny-qwen2", tmp_path_factory.mktemp("tool-ckpt"))
    config = json.loads((src / "tokenizer_config.json").read_text())
    (src / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TOOL_TEMPLATE}))
    return build(BuildConfig(source=str(src), out=tmp_path_factory.mktemp("tool-artifact") / "tiny-qwen2-tools"))


@pytest.fixture(scope="module")
def client(start_module_server, tool_artifact):
    server = start_module_server(tool_artifact, *TINY_FLAGS, "--served-model-name", "tools")
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _check_call(call, name: str | None = None) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    assert name is None or call.function.name == name
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, PARAMETERS[call.function.name])
    return args


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=3), dict(temperature=1.5, seed=4)])
@pytest.mark.parametrize("name", ["get_weather", "lookup"])
def test_named_tool_choice_always_calls_that_function(client, name, sampling):
    out = client.chat.completions.create(model="tools", messages=ASK, tools=TOOLS, max_tokens=250,
                                         tool_choice={"type": "function", "function": {"name": name}}, **sampling)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    _check_call(choice.message.tool_calls[0], name)


@pytest.mark.parametrize("seed", range(4))
def test_required_tool_choice_calls_one_of_the_tools(client, seed):
    out = client.chat.completions.create(model="tools", messages=ASK, tools=TOOLS, tool_choice="required",
                                         max_tokens=250, temperature=1.0, seed=seed)
    (call,) = out.choices[0].message.tool_calls
    _check_call(call)


def test_streamed_tool_call_arrives_as_deltas(client):
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(model="tools", messages=ASK, tools=TOOLS, max_tokens=250, stream=True,
                                                tool_choice={"type": "function", "function": {"name": "get_weather"}}):
        delta = chunk.choices[0].delta
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0]
    assert calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    jsonschema.validate(json.loads(calls[0]["arguments"]), PARAMETERS["get_weather"])


def test_a_call_cut_by_max_tokens_is_length_and_text(client):
    out = client.chat.completions.create(model="tools", messages=ASK, tools=TOOLS, max_tokens=20, temperature=0,
                                         tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = out.choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert choice.message.content.startswith("<tool_call>")


def test_auto_and_none_answer_and_history_with_tool_results_renders(client):
    for choice in ("auto", "none"):
        out = client.chat.completions.create(model="tools", messages=ASK, tools=TOOLS, tool_choice=choice,
                                             max_tokens=8, temperature=0)
        assert out.choices[0].finish_reason in ("length", "stop", "tool_calls")
    first = client.chat.completions.create(model="tools", messages=ASK, tools=TOOLS, max_tokens=250, temperature=0,
                                           tool_choice="required").choices[0].message
    history = ASK + [first.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "18 C, sunny"}]
    out = client.chat.completions.create(model="tools", messages=history, tools=TOOLS, max_tokens=8, temperature=0)
    assert out.choices[0].finish_reason in ("length", "stop", "tool_calls")


@pytest.mark.parametrize("extra, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
      "tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_unusable_tools_are_400(client, extra, param):
    body = {"tools": TOOLS, **extra}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tools", messages=ASK, max_tokens=5, extra_body=body)
    assert e.value.body["param"] == param, e.value.body
