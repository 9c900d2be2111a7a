"""Real prompt text of a given token length, cut from a fixed corpus.

Workloads speak in tokens; targets take text. A TokenCounter bridges the two: exact when the
tool has the model's tokenizer (the in-process engine, or `--tokenizer` for a URL), otherwise a
characters-per-token ratio calibrated against the server's own usage counts.
"""

from __future__ import annotations

import bisect
import itertools
import random
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Protocol

CORPUS = Path(__file__).resolve().parents[2] / "tests" / "data" / "perplexity.txt"
FALLBACK_WORDS = 4000
CACHE_ENTRIES = 256


class TokenCounter(Protocol):
    exact: bool

    def words_for(self, words: list[str], num_tokens: int) -> int:
        """How many of `words` make a text of at most num_tokens tokens."""


@dataclass(frozen=True)
class Prompt:
    system: str | None
    user: str

    def as_messages(self) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [{"role": "user", "content": self.user}]

    def as_text(self) -> str:
        return f"{self.system}\n\n{self.user}" if self.system else self.user


class ExactCounter:
    """Counts with the model's tokenizer (a `tokenizers.Tokenizer`): one encode of the whole span
    finds where token n starts; a second checks the cut, since merges across it may differ."""

    exact = True

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def encode(self, text: str):
        # NOTE: encode_batch releases the GIL (encode does not), so rendering on a worker thread
        # leaves the load generator's event loop free to timestamp other requests' chunks.
        return self.tokenizer.encode_batch([text], add_special_tokens=False)[0]

    def count(self, text: str) -> int:
        return len(self.encode(text).ids)

    def words_for(self, words: list[str], num_tokens: int) -> int:
        encoding = self.encode(" ".join(words))
        if len(encoding.ids) <= num_tokens:
            return len(words)
        cut = encoding.offsets[num_tokens][0]          # where the first token past the budget starts
        ends = list(itertools.accumulate(len(w) + 1 for w in words))    # one past each word's space
        k = bisect.bisect_right(ends, cut + 1)          # words that end before the cut
        while k > 1 and self.count(" ".join(words[:k])) > num_tokens:
            k -= 1
        return max(k, 1)            # never an empty prompt, even if one word overshoots a tiny budget


def exact_counter(tokenizer_dir: str) -> ExactCounter:
    """An exact counter from an artifact folder or a tokenizer folder (its tokenizer.json)."""
    from kiln.tokenizer import Tokenizer

    folder = Path(tokenizer_dir)
    folder = folder / "tokenizer" if (folder / "tokenizer").is_dir() else folder    # an artifact, or its tokenizer/
    if not (folder / "tokenizer.json").is_file():
        raise ValueError(f"no tokenizer.json under {tokenizer_dir}: give an artifact or a tokenizer folder")
    return ExactCounter(Tokenizer(folder).fast)


class RatioCounter:
    """Estimates from characters per token; `safety` keeps an estimate under the real count."""

    exact = False

    def __init__(self, chars_per_token: float, safety: float = 0.9):
        self.chars_per_token, self.safety = chars_per_token, safety

    def words_for(self, words: list[str], num_tokens: int) -> int:
        budget, used = num_tokens * self.chars_per_token * self.safety, 0
        for n, word in enumerate(words):
            used += len(word) + 1
            if used > budget:
                return max(n, 1)
        return len(words)


@lru_cache(maxsize=1)
def corpus_words() -> tuple[str, ...]:
    """The words of tests/data/perplexity.txt, or seeded made-up words where it is not shipped."""
    if CORPUS.is_file():
        return tuple(CORPUS.read_text(encoding="utf-8").split())
    rng = random.Random(0)
    letters = "etaoinshrdlucmfwypvbgkqjxz"
    return tuple("".join(rng.choices(letters, k=rng.randint(2, 9))) for _ in range(FALLBACK_WORDS))


class TextSource:
    """Cuts text of a token length from the corpus at an offset (wrapping round)."""

    def __init__(self, counter: TokenCounter, words: tuple[str, ...] | None = None):
        self.counter, self.words = counter, words or corpus_words()
        self._cache: dict[tuple[int, int], str] = {}

    def text(self, offset: int, num_tokens: int) -> str:
        key = (offset % len(self.words), num_tokens)
        if key not in self._cache:
            if len(self._cache) >= CACHE_ENTRIES:     # user texts rarely repeat; shared prefixes do
                self._cache.clear()
            self._cache[key] = self._cut(*key)
        return self._cache[key]

    def _cut(self, start: int, num_tokens: int) -> str:
        # Enough words for any tokenizer: each word is at least one token.
        span = [self.words[(start + i) % len(self.words)] for i in range(num_tokens)]
        return " ".join(span[:self.counter.words_for(span, num_tokens)])


def render(spec, source: TextSource) -> Prompt:
    """A RequestSpec's prompt: the shared system prompt (if any) and the request's own text."""
    system = source.text(spec.prefix_offset, spec.prefix_tokens) if spec.prefix_tokens else None
    return Prompt(system, source.text(spec.text_offset, spec.prompt_tokens))
