"""The tool-call parser: whole replies and streams agree however the text is split; blocks that do
not parse, are unclosed, or come past max_calls stay text; the forced-call grammar's shape."""

from __future__ import annotations

import json

from hypothesis import given, strategies as st

from kiln.serving.openai.tools import ToolCallStream, forced_call_grammar, parse_tool_calls, template_takes_tools

CALL_F = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
CALL_G = '<tool_call>{"name": "g", "arguments": {}}</tool_call>'
REPLY = f"Let me check. {CALL_F}\n{CALL_G} done <tool"


def _streamed(text: str, cuts: list[int], max_calls: int) -> tuple[str, list[dict]]:
    stream, events, last = ToolCallStream(max_calls), [], 0
    for cut in sorted(set(cuts)) + [len(text)]:
        events += stream.feed(text[last:cut])
        last = cut
    events += stream.finish()
    content = "".join(v for k, v in events if k == "content")
    return content, [v for k, v in events if k == "call"]


def _names(calls) -> list[str]:
    return [c["function"]["name"] for c in calls]


def test_whole_reply():
    content, calls = parse_tool_calls(REPLY, 64)
    assert _names(calls) == ["f", "g"] and json.loads(calls[0]["function"]["arguments"]) == {"a": 1}
    assert content == "Let me check. \n done <tool"
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)


def test_max_calls_leaves_the_rest_as_text():
    content, calls = parse_tool_calls(REPLY, 1)
    assert _names(calls) == ["f"] and CALL_G in content


def test_a_block_that_does_not_parse_stays_text():
    bad = '<tool_call>{"name": oops}</tool_call>'
    assert parse_tool_calls(f"a {bad} b", 64) == (f"a {bad} b", [])
    assert _streamed(f"a {bad} b", [3, 9], 64) == (f"a {bad} b", [])


def test_an_unclosed_call_is_returned_as_text_when_the_stream_ends():
    text = 'x <tool_call>{"name": "f", "argu'
    assert _streamed(text, [4, 12], 64) == (text, [])
    assert parse_tool_calls(text, 64) == (text, [])


@given(st.lists(st.integers(0, len(REPLY)), max_size=12), st.sampled_from([1, 2, 64]))
def test_streams_agree_with_the_whole_reply_however_split(cuts, max_calls):
    whole_content, whole_calls = parse_tool_calls(REPLY, max_calls)
    content, calls = _streamed(REPLY, cuts, max_calls)
    assert _names(calls) == _names(whole_calls)
    # The whole reply's content is stripped; the stream sends content as it comes.
    assert content.strip() == (whole_content or "")


def test_forced_call_grammar_and_template_detection():
    tools = [{"name": "f", "parameters": {"type": "object"}}, {"name": "g"}]
    assert '"const": "f"' in forced_call_grammar(tools, "f").source
    assert "anyOf" in forced_call_grammar(tools, None).source
    assert template_takes_tools("{% if tools %}x{% endif %}") and not template_takes_tools("{{ messages }}")
    assert not template_takes_tools(None)


def test_two_calls_closing_in_one_delta_get_their_own_indexes():
    from kiln.runtime.outputs import StreamDelta
    from kiln.serving.openai.responses import Renderer

    renderer = Renderer("chat", "m", tokenizer=None, parse_tool_calls=8)
    delta = StreamDelta("r", f"{CALL_F}{CALL_G}", [], finished=True, finish_reason="stop")
    chunks = renderer._tool_chunks(delta)
    indexes = [c["choices"][0]["delta"]["tool_calls"][0]["index"] for c in chunks
               if "tool_calls" in c["choices"][0]["delta"]]
    assert indexes == [0, 1] and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
