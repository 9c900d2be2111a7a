"""Tool-call syntaxes per family (kiln/serving/openai/tool_formats.py): chosen from the template, parsed
whole and streamed chunk by chunk to the same calls, and a reply that is not a call stays content."""

from __future__ import annotations

import json

import pytest

from kiln.serving.openai.tool_formats import WholeReplyCalls, call_stream, format_for_template, split_calls

LLAMA3 = '{{ "<|start_header_id|>" }}{% if tools %}{{ tools | tojson }}{% endif %}<|python_tag|><|eom_id|>'
MISTRAL = "{% for m in messages %}[INST]{{ m.content }}[/INST]{% endfor %}[AVAILABLE_TOOLS][TOOL_CALLS]"
HERMES = "{% if tools %}<tools></tools>{% endif %}<tool_call>"


def test_the_format_comes_from_the_template():
    assert format_for_template(LLAMA3) == "llama3_json"
    assert format_for_template(MISTRAL) == "mistral"
    assert format_for_template(HERMES) == "hermes" and format_for_template(None) == "hermes"


@pytest.mark.parametrize("fmt, reply, calls", [
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
     [("get_weather", {"city": "Paris"})]),
    ("llama3_json", '{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}', [("a", {}), ("b", {"x": 1})]),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]',
     [("f", {"x": 1}), ("g", {})]),
    ("mistral", '[{"name": "f", "arguments": {"x": 1}}]', [("f", {"x": 1})]),        # marker skipped as special
    ("mistral", '[TOOL_CALLS]f[ARGS]{"x": 1}[TOOL_CALLS]g[ARGS]{}', [("f", {"x": 1}), ("g", {})]),
])
def test_calls_parse_whole_and_streamed(fmt, reply, calls):
    assert split_calls(fmt, reply, 8) == (None, calls)
    stream = call_stream(fmt, 8)
    events = [e for i in range(0, len(reply), 3) for e in stream.feed(reply[i:i + 3])] + stream.finish()
    streamed = [(e[1]["function"]["name"], json.loads(e[1]["function"]["arguments"])) for e in events]
    assert [kind for kind, _ in events] == ["call"] * len(calls) and streamed == calls and stream.num_calls == len(calls)


@pytest.mark.parametrize("fmt", ["llama3_json", "mistral"])
@pytest.mark.parametrize("reply", ["The weather is fine.", '{"city": "Paris"}', '[1, 2]', '{"name": "f", "para'])
def test_a_reply_that_is_not_wholly_calls_is_content(fmt, reply):
    assert split_calls(fmt, reply, 8) == (reply, [])
    stream = WholeReplyCalls(fmt, 8)
    events = stream.feed(reply[:4]) + stream.feed(reply[4:]) + stream.finish()
    assert "".join(text for kind, text in events if kind == "content") == reply and stream.num_calls == 0


def test_plain_content_streams_at_once():
    stream = WholeReplyCalls("llama3_json", 8)
    assert stream.feed("  Hel") == [("content", "  Hel")] and stream.feed("lo") == [("content", "lo")]
    assert WholeReplyCalls("mistral", 8).feed("[TOOL_") == []       # could still be the marker


def test_more_calls_than_allowed_stay_content():
    reply = '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {}}'
    assert split_calls("llama3_json", reply, 1) == (reply, [])


def test_the_tool_call_parser_option_overrides_the_template():
    from types import SimpleNamespace

    from kiln.serving.openai.protocol import ChatCompletionRequest
    from kiln.serving.openai.structured_requests import plan_tools
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]})
    tok = SimpleNamespace(chat_template=HERMES.replace("<tools></tools>", "{{ tools }}"))
    assert plan_tools(body, tok).format == "hermes"
    assert plan_tools(body, tok, "mistral").format == "mistral"
