"""Stop-string matching over a growing text."""

from __future__ import annotations


class StopMatcher:
    """Finds stop strings in a text that only ever grows at its end."""

    def __init__(self, stops: tuple[str, ...] | list[str]):
        self.stops = tuple(s for s in stops if s)
        self.longest = max((len(s) for s in self.stops), default=0)
        self._first_chars = {s[0] for s in self.stops}

    def find(self, text: str, start: int = 0) -> tuple[int, str] | None:
        """The stop string that completes first in text[start:], and the index where it begins.

        Completing first (then beginning first) is what a character-by-character scan would
        report, so the answer does not depend on how the text arrived.
        """
        best = None
        for stop in self.stops:
            index = text.find(stop, start)
            if index >= 0 and (best is None or (index + len(stop), index) < best[0]):
                best = ((index + len(stop), index), stop)
        return None if best is None else (best[0][1], best[1])

    def search_start(self, scanned: int) -> int:
        """Where to resume find() when text[:scanned] was searched already and held no stop."""
        return max(0, scanned - self.longest + 1)

    def partial_len(self, text: str) -> int:
        """Length of the longest suffix of text that could begin a stop string: the text to hold back."""
        tail = text[max(0, len(text) - self.longest + 1):] if self.longest > 1 else ""
        for start, char in enumerate(tail):
            if char in self._first_chars:
                piece = tail[start:]
                if any(s.startswith(piece) for s in self.stops):
                    return len(piece)
        return 0
