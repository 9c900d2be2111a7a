"""Prompt lookup (n-gram) proposals: if the text so far ends with an n-gram that occurred
earlier, guess that what followed it then follows it now.

Strong when the answer quotes its input (summaries, edits, code, retrieval-augmented answers)
and free to compute: no model runs. Each request keeps an index from n-gram to the end of its
latest occurrence, extended by the tokens appended since the last call, so a proposal costs
O(new tokens x n) rather than a scan of the whole sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class NgramIndex:
    """n-gram -> end position of its latest occurrence, for one growing token sequence."""
    ngram_min: int
    ngram_max: int
    latest: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0        # n-grams ending before this position are in `latest`

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest suffix n-gram's latest earlier occurrence."""
        # NOTE: the suffix's own occurrence ends at len - 1; it stays out of the index until
        # the next token arrives, so a match always has a continuation.
        self._extend(tokens, len(tokens) - 1)
        for n in range(min(self.ngram_max, len(tokens) - 1), self.ngram_min - 1, -1):
            end = self.latest.get(tuple(tokens[-n:]))
            if end is not None:
                return list(tokens[end + 1:end + 1 + k])
        return []

    def _extend(self, tokens: Sequence[int], stop: int) -> None:
        for end in range(self.indexed, stop):
            for n in range(self.ngram_min, min(self.ngram_max, end + 1) + 1):
                self.latest[tuple(tokens[end - n + 1:end + 1])] = end
        self.indexed = max(self.indexed, stop)


class NgramProposer:
    """The Proposer for `--speculative ngram`."""

    def __init__(self, ngram_min: int = 2, ngram_max: int = 4):
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self._indexes: dict[str, NgramIndex] = {}

    def propose(self, requests: Sequence[tuple[object, int]]) -> dict[str, list[int]]:
        out = {}
        for request, k in requests:
            index = self._indexes.get(request.request_id)
            if index is None:
                index = self._indexes[request.request_id] = NgramIndex(self.ngram_min, self.ngram_max)
            proposal = index.propose(request.all_token_ids, k)
            if proposal:
                out[request.request_id] = proposal
        return out

    def forget(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)
