"""Incremental, stream-safe detokenization with stop strings.

Each step decodes a short window of tokens, not the whole output: the tokens of the last emitted
chunk (prefix_offset:read_offset) plus the new ones. The text the window adds past its prefix is
the new text. A window whose text ends in U+FFFD is a multi-byte character still arriving; it is
held (the offsets stay) until the character completes, or until finish().

NOTE: the window starts on an already-decoded token so that decoders which treat the first token
specially (SentencePiece's leading-space strip) decode new tokens as they read in context. The
first window takes its context from the prompt's last tokens; with a byte-level BPE tokenizer the
streamed text therefore equals tokenizer.decode(output_ids); with a SentencePiece-style one it
keeps the leading space the prompt context implies.
"""

from __future__ import annotations

from typing import Sequence

from tokenizers import Tokenizer

from kiln.runtime.stop_strings import StopMatcher

REPLACEMENT = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True, stop: Sequence[str] = (), include_stop: bool = False):
        """include_stop: the stop string that ends the output stays in its text (vLLM's
        include_stop_str_in_output)."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.include_stop = include_stop
        self.stop_matcher = StopMatcher(tuple(stop))
        self.output_token_ids: list[int] = []
        self.output_text = ""           # streamed so far: never held-back text or text past a stop
        self.stopped = False
        self.stop_reason: str | None = None
        self.finished = False
        self._committed = ""            # decoded output text up to read_offset
        self._pending = ""              # decoded past read_offset, less a trailing run of U+FFFD
        self._scanned = 0               # length of the text already searched for stop strings
        self._start_window(list(prompt_token_ids)[-PROMPT_CONTEXT_TOKENS:])

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Add tokens; return the text that is now safe to stream (possibly "")."""
        if self.stopped or self.finished or not new_token_ids:
            return ""
        self.output_token_ids.extend(new_token_ids)
        self._ids.extend(new_token_ids)
        self._decode_window(final=False)
        return self._release(final=False)

    def finish(self) -> str:
        """Flush held-back text (incomplete characters, a possible stop-string start)."""
        if self.stopped or self.finished:
            return ""
        self.finished = True
        self._decode_window(final=True)
        return self._release(final=True)

    # ---- decoding ----

    def _start_window(self, context: list[int]) -> None:
        context_text = self._decode(context)
        if context_text.endswith(REPLACEMENT):
            # The prompt ends inside a character: its bytes would merge with the output's.
            context, context_text = [], ""
        self._ids = context
        self._prefix_offset, self._read_offset = 0, len(context)
        self._prefix_text = context_text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_window(self, final: bool) -> None:
        fresh = self._decode(self._ids[self._prefix_offset:])[len(self._prefix_text):]
        # Skipped special tokens add no text: keep the window's start on a token that did, so
        # the next token still decodes in context.
        if not final and (not fresh or fresh.endswith(REPLACEMENT)):
            self._pending = fresh.rstrip(REPLACEMENT)
            return
        self._committed += fresh
        self._pending = ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])

    # ---- stop strings and release ----

    def _release(self, final: bool) -> str:
        # Text before a trailing run of U+FFFD never changes as tokens arrive, so it can be
        # searched and streamed now.
        text = self._committed + self._pending
        hit = self.stop_matcher.find(text, self.stop_matcher.search_start(self._scanned))
        self._scanned = len(text)
        if hit is not None:
            end, self.stop_reason = hit
            end += len(self.stop_reason) if self.include_stop else 0
            self.stopped = True
        elif final:
            end = len(text)
        else:
            end = len(text) - self.stop_matcher.partial_len(text)
        delta = text[len(self.output_text):max(end, len(self.output_text))]
        self.output_text += delta
        return delta
