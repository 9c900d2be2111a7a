"""Tool-call syntaxes per model family, chosen from the chat template: how calls are parsed out of
a reply (whole or streamed) and the grammar that forces one (`tool_choice` required or named).

    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>      Qwen2.5, Hermes, SmolLM3
    llama3_json  <|python_tag|>{"name": ..., "parameters": {...}}; {...}       Llama 3.1 / 3.2
    mistral      [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]          Mistral (v3 tokenizer)
                 [TOOL_CALLS]name[ARGS]{...}                                   Mistral (v11+)

NOTE: <|python_tag|> and [TOOL_CALLS] are special tokens, so the reply's text usually lacks
them (skip_special_tokens): llama3_json and mistral replies are calls when their text is one
(a JSON object or list of calls, after an optional marker), otherwise content. Their streams hold
a reply that starts like a call until it ends, then emit calls or content; Hermes streams
content as it comes and each call as it closes (tools.ToolCallStream).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from kiln.runtime.structured import StructuredOutput
from kiln.runtime.structured.grammar import JSON_STYLE
from kiln.serving.openai import tools as hermes

ANY_OBJECT = {"type": "object"}
FORMATS = ("hermes", "llama3_json", "mistral")


def format_for_template(chat_template: str | None) -> str:
    """The tool-call syntax the template teaches the model (hermes when it names none)."""
    t = chat_template or ""
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<|python_tag|>" in t or ("<|start_header_id|>" in t and "<tool_call>" not in t):
        return "llama3_json"
    return "hermes"


def split_calls(fmt: str, text: str, max_calls: int) -> tuple[str | None, list[tuple[str, object]]]:
    """(content or None, up to max_calls (name, arguments)); a reply that is not wholly calls is content."""
    if fmt == "hermes":
        return hermes.split_tool_calls(text, max_calls)
    calls = _llama3_calls(text) if fmt == "llama3_json" else _mistral_calls(text)
    if calls is None or len(calls) > max_calls:
        return (text.strip() or None), []
    return None, calls


def forced_grammar(fmt: str, tools: list[dict], name: str | None) -> StructuredOutput:
    """Exactly one call, of `name` or of any tool, in the format's own syntax."""
    if fmt == "hermes":
        return hermes.forced_call_grammar(tools, name)
    args_key = "parameters" if fmt == "llama3_json" else "arguments"
    schemas = [_call_schema(t, args_key) for t in tools if name is None or t["name"] == name]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    if fmt == "mistral":          # a list of one call; the [TOOL_CALLS] marker is optional to the parser
        schema = {"type": "array", "items": schema, "minItems": 1, "maxItems": 1}
    return StructuredOutput.json_schema({**schema, "x-guidance": JSON_STYLE})


def call_stream(fmt: str, max_calls: int):
    return hermes.ToolCallStream(max_calls) if fmt == "hermes" else WholeReplyCalls(fmt, max_calls)


@dataclass
class WholeReplyCalls:
    """The stream of a format whose calls are the whole reply: content streams as it comes unless
    the reply starts like a call ("{", "[", a marker), which is held and parsed when it ends."""
    fmt: str
    max_calls: int
    num_calls: int = 0
    _held: str = ""
    _decided: bool | None = None        # None: undecided; True: held as a call; False: content
    _starts: tuple[str, ...] = field(default=("{", "[", "<|python_tag|>", "[TOOL_CALLS]"))

    def feed(self, text: str) -> list[tuple[str, object]]:
        if self._decided is False:
            return [("content", text)] if text else []
        self._held += text
        head = self._held.lstrip()
        if self._decided or not head:
            return []
        if any(head.startswith(s) for s in self._starts):
            self._decided = True
        elif not any(s.startswith(head) for s in self._starts):     # cannot become a marker any more
            self._decided = False
            out, self._held = self._held, ""
            return [("content", out)]
        return []

    def finish(self) -> list[tuple[str, object]]:
        held, self._held = self._held, ""
        content, calls = split_calls(self.fmt, held, self.max_calls)
        self.num_calls += len(calls)
        events = [("call", hermes.tool_call(name, args)) for name, args in calls]
        return events or ([("content", held)] if held else [])


def _call_schema(tool: dict, args_key: str) -> dict:
    return {"type": "object", "properties": {"name": {"const": tool["name"]},
                                             args_key: tool.get("parameters") or ANY_OBJECT},
            "required": ["name", args_key], "additionalProperties": False}


def _llama3_calls(text: str) -> list[tuple[str, object]] | None:
    """`{"name", "parameters"|"arguments"}` objects separated by ';', after an optional <|python_tag|>."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return None
    calls, decoder, pos = [], json.JSONDecoder(), 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except (ValueError, RecursionError):
            return None
        call = _named(obj, ("parameters", "arguments"))
        if call is None:
            return None
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return calls


def _mistral_calls(text: str) -> list[tuple[str, object]] | None:
    body = text.strip().removeprefix("[TOOL_CALLS]").strip()
    if "[ARGS]" in body and not body.startswith("["):       # v11+: name[ARGS]{...} per call
        return _mistral_v11_calls(body)
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    items = obj if isinstance(obj, list) else [obj]
    calls = [_named(item, ("arguments", "parameters")) for item in items]
    return None if not calls or any(c is None for c in calls) else calls


def _mistral_v11_calls(body: str) -> list[tuple[str, object]] | None:
    calls = []
    for part in body.split("[TOOL_CALLS]"):
        name, sep, args = part.strip().partition("[ARGS]")
        if not sep or not name.strip():
            return None
        try:
            calls.append((name.strip(), json.loads(args)))
        except (ValueError, RecursionError):
            return None
    return calls


def _named(obj, arg_keys: tuple[str, ...]) -> tuple[str, object] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in arg_keys if k in obj), {})
    return obj["name"], args
