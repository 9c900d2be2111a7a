"""A `<think>` block into `reasoning_content` (Qwen3, DeepSeek-R1 and other templates that write
`<think>` and `</think>`): the text before `</think>` is the model's reasoning, the rest its
answer, whole or streamed.

The block opens in the reply (`<think>` first) or in the prompt: a template whose generation
prompt ends with `<think>` (thinking on) has the reply start inside the block; one that closes it
there (Qwen3's enable_thinking false writes `<think>\\n\\n</think>`) has no reasoning. A reply
whose block never closes (cut by max_tokens) is all reasoning.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def template_reasons(chat_template: str | None) -> bool:
    return bool(chat_template) and OPEN in chat_template and CLOSE in chat_template


def prompt_opens_block(prompt_tail: str) -> bool:
    """Whether the rendered prompt leaves a <think> block open for the reply."""
    tail = prompt_tail.rstrip()
    return tail.endswith(OPEN)


def split_reasoning(text: str, opened: bool) -> tuple[str | None, str]:
    """(the reasoning or None, the content)."""
    head = text.lstrip()
    if head.startswith(OPEN):
        text, opened = head[len(OPEN):], True
    if not opened:
        return None, text
    end = text.find(CLOSE)
    if end < 0:
        return text or None, ""
    return text[:end] or None, text[end + len(CLOSE):].lstrip()


class ReasoningStream:
    """Splits streamed text into ("reasoning", text) and ("content", text) events; a tail that may
    be the start of a marker is held until it is clearly not."""

    def __init__(self, opened: bool):
        self.state = "reasoning" if opened else "start"
        self.buffer = ""
        self._strip = False            # the blank line after </think> is dropped, as split_reasoning does

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.buffer += text
        out: list[tuple[str, str]] = []
        if self.state == "start":
            head = self.buffer.lstrip()
            if head.startswith(OPEN):
                self.state, self.buffer = "reasoning", head[len(OPEN):]
            elif head and not OPEN.startswith(head):
                self.state = "content"
            else:
                return out
        if self.state == "reasoning":
            end = self.buffer.find(CLOSE)
            if end < 0:
                keep = _partial_suffix(self.buffer, CLOSE)
                cut = len(self.buffer) - keep
                out.append(("reasoning", self.buffer[:cut]))
                self.buffer = self.buffer[cut:]
                return [e for e in out if e[1]]
            out.append(("reasoning", self.buffer[:end]))
            self.state, self.buffer, self._strip = "content", self.buffer[end + len(CLOSE):], True
        if self.state == "content":
            out.append(("content", self._content(self.buffer)))
            self.buffer = ""
        return [e for e in out if e[1]]

    def finish(self) -> list[tuple[str, str]]:
        rest, self.buffer = self.buffer, ""
        if self.state == "content":
            rest = self._content(rest)
        return [("reasoning" if self.state == "reasoning" else "content", rest)] if rest else []

    def _content(self, text: str) -> str:
        if self._strip:
            text = text.lstrip()
            self._strip = not text
        return text


def _partial_suffix(text: str, marker: str) -> int:
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
