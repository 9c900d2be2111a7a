"""Per-key fairness for requests of many choices: each API key's requests in flight together
reserve at most a budget of tokens, a choice reserving its prompt and its max_tokens. Without it,
one caller sending n = 64 with the whole context per choice filled the waiting queue in four
requests and everyone else got 429 (each choice is admitted on its own). Event-loop thread only."""

from __future__ import annotations

from collections import Counter
from typing import Callable

from kiln.serving.http.errors import ApiError, bad_request


class KeyBudget:
    def __init__(self, limit: int | None):
        """limit: tokens per key (None: no bound)."""
        self.limit = limit
        self.held: Counter = Counter()           # key name -> tokens reserved by its requests in flight

    def charge(self, key: str | None, tokens: int) -> Callable[[], None]:
        """Reserve `tokens` for `key` (None: no keys configured, nothing to be fair between);
        returns the release, which may be called more than once. 400 for a request that could
        never fit, 429 while the key's other requests hold the rest."""
        if self.limit is None or key is None:
            return _nothing
        if tokens > self.limit:
            raise bad_request(f"this request reserves {tokens} tokens (choices x (prompt + max_tokens)); an API "
                              f"key may reserve at most {self.limit}: lower n or max_tokens", "n", "key_budget_exceeded")
        if self.held[key] + tokens > self.limit:
            raise ApiError(429, f"this API key's requests in flight reserve {self.held[key]} tokens and this one "
                           f"adds {tokens} (max {self.limit} per key); retry in 1 s", None, "key_budget",
                           headers={"Retry-After": "1"})
        self.held[key] += tokens
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.held[key] -= tokens
                if not self.held[key]:
                    del self.held[key]
        return release


def _nothing() -> None:
    pass
