"""OpenAI `tools` on a Qwen2/Hermes-style chat template: which templates take tools, the grammar
that forces a call (`tool_choice` "required" or a named function), and the model's tool-call
syntax parsed back into OpenAI `tool_calls`, whole or as a stream.

The syntax (Qwen2.5, Hermes 2 Pro, SmolLM3 ... templates):
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from kiln.runtime.structured import StructuredOutput
from kiln.runtime.structured.grammar import JSON_STYLE

OPEN, CLOSE = "<tool_call>", "</tool_call>"
ANY_OBJECT = {"type": "object"}


def template_takes_tools(chat_template: str | None) -> bool:
    # A template that never reads `tools` would drop them silently: the model would not know them.
    return bool(chat_template) and re.search(r"\btools\b", chat_template) is not None


def forced_call_grammar(tools: list[dict], name: str | None) -> StructuredOutput:
    """A grammar for exactly one call: of `name`, or of any of `tools` when name is None."""
    chosen = [t for t in tools if name is None or t["name"] == name]
    schemas = [_call_schema(t) for t in chosen]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    schema["x-guidance"] = JSON_STYLE
    lark = f"start: {json.dumps(OPEN + chr(10))} %json {json.dumps(schema)} {json.dumps(chr(10) + CLOSE)}"
    return StructuredOutput.grammar(lark)


def _call_schema(tool: dict) -> dict:
    return {"type": "object", "properties": {"name": {"const": tool["name"]},
                                             "arguments": tool.get("parameters") or ANY_OBJECT},
            "required": ["name", "arguments"], "additionalProperties": False}


# ---- parsing the model's output ----

def tool_call(name: str, arguments) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": args}}


def _parse_call(body: str) -> dict | None:
    parsed = _parse_call_parts(body)
    return None if parsed is None else tool_call(*parsed)


def _parse_call_parts(body: str) -> tuple[str, object] | None:
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return obj["name"], obj.get("arguments", {})


def split_tool_calls(text: str, max_calls: int) -> tuple[str | None, list[tuple[str, object]]]:
    """(the text outside well-formed calls or None, the first max_calls calls as (name, arguments)).
    A block that does not parse, or is past max_calls, stays in the text, so nothing the model
    wrote is lost. One forward scan with str.find: linear in the text's length (a regex with
    `\\s*(.*?)\\s*` backtracked quadratically on a long unclosed reply)."""
    calls, kept, last, pos = [], [], 0, 0
    while len(calls) < max_calls:
        start = text.find(OPEN, pos)
        if start < 0:
            break
        end = text.find(CLOSE, start + len(OPEN))
        if end < 0:
            break                        # no close after this open: none after any later one either
        pos = end + len(CLOSE)
        call = _parse_call_parts(text[start + len(OPEN):end].strip())
        if call is not None:
            kept.append(text[last:start])
            last = pos
            calls.append(call)
    kept.append(text[last:])
    content = "".join(kept).strip()
    return (content or None), calls


def parse_tool_calls(text: str, max_calls: int) -> tuple[str | None, list[dict]]:
    """split_tool_calls with each call an OpenAI tool call (a fresh id each time)."""
    content, calls = split_tool_calls(text, max_calls)
    return content, [tool_call(name, arguments) for name, arguments in calls]


@dataclass
class ToolCallStream:
    """Splits streamed text into content and whole tool calls. Text that might be the start of
    `<tool_call>` is held back until it is clearly not; a call is emitted when it closes. After
    max_calls calls, the rest is content."""
    max_calls: int
    buffer: str = ""
    in_call: bool = False
    num_calls: int = 0
    _searched: int = 0          # inside a call: the buffer before this holds no CLOSE (linear scans)

    def feed(self, text: str) -> list[tuple[str, object]]:
        """[("content", str) | ("call", dict)] for what `text` completes."""
        self.buffer += text
        out = []
        while self.buffer:
            if self.in_call:
                end = self.buffer.find(CLOSE, self._searched)
                if end < 0:
                    self._searched = max(0, len(self.buffer) - len(CLOSE) + 1)
                    break
                out.append(self._close(self.buffer[:end]))
                self.buffer, self._searched = self.buffer[end + len(CLOSE):], 0
                continue
            start = self.buffer.find(OPEN) if self.num_calls < self.max_calls else -1
            if start < 0:
                out.append(("content", self._take_content()))
                break
            if start:
                out.append(("content", self.buffer[:start]))
            self.buffer, self.in_call, self._searched = self.buffer[start + len(OPEN):], True, 0
        return [event for event in out if event[1]]

    def _take_content(self) -> str:
        """The buffer, less a tail that could still become `<tool_call>` (while calls may follow)."""
        keep = _partial_prefix(self.buffer, OPEN) if self.num_calls < self.max_calls else 0
        cut = len(self.buffer) - keep
        text, self.buffer = self.buffer[:cut], self.buffer[cut:]
        return text

    def finish(self) -> list[tuple[str, object]]:
        """What is left when the stream ends: an unclosed call is returned as plain text."""
        rest = (OPEN + self.buffer) if self.in_call else self.buffer
        self.buffer, self.in_call, self._searched = "", False, 0
        return [("content", rest)] if rest else []

    def _close(self, body: str) -> tuple[str, object]:
        self.in_call = False
        call = _parse_call(body.strip())
        if call is None:
            return ("content", OPEN + body + CLOSE)
        self.num_calls += 1
        return ("call", call)


def _partial_prefix(text: str, marker: str) -> int:
    """The length of the longest suffix of text that is a proper prefix of marker."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
