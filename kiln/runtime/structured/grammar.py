"""llguidance behind two small classes: GrammarCompiler (one per tokenizer: validates a
StructuredOutput and binds it to the tokenizer) and Guide (one per request: the token mask for
the next step, advanced by each accepted token).

Why llguidance (the comparison on SmolLM2's vocabulary: docs/results/2026-11-30-structured-output.md
and docs/results/2026-12-06-figures-from-code-comments.md): it builds a matcher and fills a step's
bitmask far faster than outlines-core compiles and answers the same schema, and xgrammar declares
torch, transformers and triton as dependencies, none of which kiln's runtime install has. llguidance also reads Lark grammars with JSON Schemas inline (%json), which the
tool-call grammar uses.
"""

from __future__ import annotations

import json
import os
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Sequence

import llguidance as llg
import numpy as np

from kiln.runtime.structured.spec import Constraint, StructuredOutput

MAX_CACHED_GRAMMARS = 256
# One JSON layout, as json.dumps writes it: no free whitespace, which the model could otherwise
# spend its whole max_tokens on (llguidance allows any amount by default). A schema's own
# "x-guidance" options still win over these.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """The schema, regex or grammar cannot be used; the message names the problem."""


@dataclass(frozen=True)
class CompiledGrammar:
    # A matcher at the start of the grammar, never advanced: each request's Guide starts from a
    # deep copy of it (far cheaper than a new matcher, which is paid here, outside the engine thread).
    matcher: llg.LLMatcher
    vocab_size: int
    eos_token_ids: tuple[int, ...]


def llguidance_grammar(spec: StructuredOutput) -> str:
    if spec.kind is Constraint.JSON_OBJECT:
        return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_STYLE)
    if spec.kind is Constraint.JSON_SCHEMA:
        return llg.LLMatcher.grammar_from_json_schema(spec.source, defaults=JSON_STYLE)
    if spec.kind is Constraint.REGEX:
        return llg.LLMatcher.grammar_from_regex(spec.source)
    if spec.kind is Constraint.CHOICE:
        return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in json.loads(spec.source)))
    return llg.LLMatcher.grammar_from_lark(spec.source)


class GrammarCompiler:
    """Validates and binds constraints for one tokenizer. The llguidance tokenizer (~0.5 s for a
    49k vocabulary) is built on first use, so a server that never sees a constraint never pays."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]):
        self._tokenizer_json = tokenizer_json
        self.vocab_size, self.eos_token_ids = vocab_size, tuple(eos_token_ids)
        self._tokenizer: llg.LLTokenizer | None = None
        self._compiled: OrderedDict[StructuredOutput, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> llg.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llg.LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size,
                                                  eos_token=list(self.eos_token_ids) or None)
            return self._tokenizer

    def bind(self, spec: StructuredOutput) -> StructuredOutput:
        """The spec with its compiled grammar attached; raises GrammarError if it is unusable."""
        if spec.compiled is not None:
            return spec
        return spec.with_compiled(self._compile(spec))

    def _compile(self, spec: StructuredOutput) -> CompiledGrammar:
        with self._lock:
            if spec in self._compiled:
                self._compiled.move_to_end(spec)
                return self._compiled[spec]
        try:
            grammar = llguidance_grammar(spec)
        except ValueError as e:
            raise GrammarError(str(e)) from None
        problem = llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if problem:
            raise GrammarError(problem.strip())
        compiled = CompiledGrammar(_start_matcher(self.tokenizer, grammar), self.vocab_size, self.eos_token_ids)
        with self._lock:
            self._compiled[spec] = compiled
            while len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return compiled


def _start_matcher(tokenizer: llg.LLTokenizer, grammar: str) -> llg.LLMatcher:
    matcher = llg.LLMatcher(tokenizer, grammar, log_level=0)
    if matcher.is_error():
        raise GrammarError(matcher.get_error())
    # The first mask warms llguidance's caches, here rather than in an engine step.
    scratch = np.empty(mask_words(tokenizer.vocab_size), dtype=np.int32)
    matcher.unsafe_compute_mask_ptr(scratch.ctypes.data, scratch.nbytes)
    return matcher


_compilers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_compilers_lock = threading.Lock()


def compiler_for(tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> GrammarCompiler:
    """The GrammarCompiler of a kiln Tokenizer (one per tokenizer object, made on first use)."""
    with _compilers_lock:
        compiler = _compilers.get(tokenizer)
        if compiler is None:
            compiler = _compilers[tokenizer] = GrammarCompiler(tokenizer.fast.to_str(), vocab_size, eos_token_ids)
        return compiler


class Guide:
    """One request's place in its grammar. fill_masks() computes its next mask; forbidden() reads it."""

    def __init__(self, compiled: CompiledGrammar):
        self.compiled = compiled
        self.matcher = compiled.matcher.deep_copy()
        self.bitmask = np.full(mask_words(compiled.vocab_size), -1, dtype=np.int32)

    def forbidden(self, width: int) -> np.ndarray:
        """A bool mask over a logits row of `width` tokens: True where the grammar forbids the token."""
        if self.matcher.is_error():
            # NOTE: cannot happen while every token is drawn under the mask; end the request
            # rather than draw from nothing.
            forbidden = np.ones(width, dtype=bool)
            forbidden[[t for t in self.compiled.eos_token_ids if t < width]] = False
            return forbidden
        # Invert the 32-bit words (cheap) rather than the unpacked bools (a pass over the vocabulary).
        bits = np.unpackbits(np.invert(self.bitmask).view(np.uint8), bitorder="little").view(bool)
        if width <= len(bits):
            return bits[:width]
        return np.concatenate([bits, np.ones(width - len(bits), dtype=bool)])   # logits past the vocabulary

    def accept(self, token_id: int) -> None:
        self.matcher.consume_token(token_id)


def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def fill_masks(guides: Sequence[Guide]) -> None:
    """Compute each guide's mask for its next token: one call, on all cores when there are several
    (llguidance's executor runs the matchers in its own threads, outside the GIL). On two cores
    under load a sample() call took as long either way; the executor is kept for machines with
    more cores, where the masks of a batch run side by side."""
    if len(guides) == 1:
        g = guides[0]
        g.matcher.unsafe_compute_mask_ptr(g.bitmask.ctypes.data, g.bitmask.nbytes)
        return
    words = {len(g.bitmask) for g in guides}
    if len(words) != 1:                          # guides of different vocabularies: one at a time
        for g in guides:
            fill_masks([g])
        return
    batch = np.empty((len(guides), words.pop()), dtype=np.int32)
    _executor().unsafe_compute_mask_ptr([(g.matcher, k) for k, g in enumerate(guides)],
                                        batch.ctypes.data, batch.shape[1] * 4, len(guides))
    for g, row in zip(guides, batch):
        g.bitmask = row


_executor_instance: llg.LLExecutor | None = None


def _executor() -> llg.LLExecutor:
    global _executor_instance
    if _executor_instance is None:
        # NOTE: its default is 80 % of the cores, which is one thread on a 2-core machine.
        _executor_instance = llg.LLExecutor(num_threads=max(1, os.cpu_count() or 1))
    return _executor_instance


def bind_params(params, tokenizer, vocab_size: int, eos_token_ids: Sequence[int]):
    """SamplingParams whose constraint (if any) is bound to `tokenizer`; raises GrammarError."""
    spec = params.structured
    if spec is None or spec.compiled is not None:
        return params
    return replace(params, structured=compiler_for(tokenizer, vocab_size, eos_token_ids).bind(spec))
