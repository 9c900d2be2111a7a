"""How many tokens to propose for a request this step: per-request acceptance and the load.

A rejected proposal is not free: the verification call computes its row, and on a CPU a
k+1-token call costs more than a decode as k grows. So each request tracks the share of its
proposals that were accepted (exponentially weighted) and proposes k = ceil(k_max x rate)
tokens; when the rate drops below OFF_RATE it sits out a number of steps that doubles with each
bad verification (up to MAX_BACKOFF) and resets at the first good one. Independently, a step
verifies at most max_step_tokens decodes plus proposals: a big decode batch already keeps the
engine busy, and proposals there only add compute. Beside other decodes a rejected row is no
longer nearly free (on SmolLM2, four chat streams with proposals ran slower than without; see
docs/results/2026-11-30-speculative-decoding.md), so there the bar is BATCHED_OFF_RATE.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

FORGET = 0.7            # weight of the past per verification: a request's regime changes fast
PRIOR_RATE = 0.6        # a new request starts by proposing, k_max x 0.6
OFF_RATE = 0.2          # below this acceptance rate the request pauses (decoding alone)
BATCHED_OFF_RATE = 0.6  # ... and beside other decodes
GOOD_RATE = 0.5         # a verification accepting this share resets the backoff
MAX_BACKOFF = 32        # steps


@dataclass
class Acceptance:
    """One request's record of its verified proposals."""
    rate: float = PRIOR_RATE
    backoff: int = 0            # the next pause, in steps
    paused: int = 0             # steps left in the current pause

    def observe(self, proposed: int, accepted: int, off_rate: float = OFF_RATE) -> None:
        share = accepted / proposed
        self.rate = FORGET * self.rate + (1 - FORGET) * share
        if share >= max(GOOD_RATE, off_rate):
            self.backoff = 0
        elif self.rate < off_rate:
            self.backoff = min(max(1, 2 * self.backoff), MAX_BACKOFF)
            self.paused = self.backoff

    def proposals(self, k_max: int) -> int:
        """Tokens to propose now (0 while paused; each call is one step)."""
        if self.paused:
            self.paused -= 1
            return 0
        return max(1, math.ceil(k_max * self.rate))


def load_limit(num_decodes: int, k_max: int, max_step_tokens: int, max_decodes: int | None = None) -> int:
    """Proposals per request when num_decodes requests decode in the step (none past max_decodes)."""
    if num_decodes <= 0 or (max_decodes is not None and num_decodes > max_decodes):
        return 0
    return max(0, min(k_max, max_step_tokens // num_decodes - 1))
