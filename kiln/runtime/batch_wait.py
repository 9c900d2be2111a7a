"""The batch wait window: hold new prompts back for a few milliseconds so that several arrivals
share one prefill step (fewer, fuller engine calls) at a bounded cost in TTFT.

The rule (the scheduler asks it once per step, before admitting waiting prompts):
- it applies only while no request decodes: the engine is idle or only prefilling. A running
  decode never waits, and prompts arriving beside decodes join the step that runs anyway;
- it holds while fewer prompts wait than the preferred batch and their tokens do not fill the
  step's prefill budget (a fuller step gains nothing from waiting);
- the hold ends `window` seconds after the oldest waiting prompt arrived, whatever comes in.

Requests already running (a chunked prefill) are scheduled as usual while the window holds the
newcomers. The engine loop sleeps on its command queue while a hold leaves it nothing to run
(EngineClient), so a hold never spins.

Each release after a hold records how long the hold lasted (`last_wait`, the
kiln_batch_wait_seconds histogram): what the window cost the first prompt of that batch.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable

from kiln.runtime.request import Request


class BatchWaitWindow:
    def __init__(self, window: float, preferred_batch: int, clock: Callable[[], float] = time.monotonic):
        self.window = window                  # seconds; 0 = off
        self.preferred_batch = preferred_batch
        self.clock = clock                    # NOTE: the clock Request.arrival_time uses
        self.remaining = 0.0                  # seconds the last decision held for (0: not holding)
        self.last_wait: float | None = None   # set by a release that ended a hold, for one step
        self._held_since: float | None = None

    def hold(self, waiting: Iterable[Request], num_decodes: int, prefill_budget: int) -> bool:
        """True: admit no waiting prompt this step. Updates `remaining` and `last_wait`."""
        waiting = list(waiting)
        self.last_wait = None
        left = self._time_left(waiting, num_decodes, prefill_budget)
        now = self.clock()
        if left > 0:
            if self._held_since is None:
                self._held_since = now
        elif self._held_since is not None:
            self.last_wait = now - self._held_since
            self._held_since = None
        self.remaining = left
        return left > 0

    def _time_left(self, waiting: list[Request], num_decodes: int, prefill_budget: int) -> float:
        if self.window <= 0 or not waiting or num_decodes:
            return 0.0
        if len(waiting) >= self.preferred_batch:
            return 0.0
        if sum(r.num_tokens - r.num_computed_tokens for r in waiting) >= prefill_budget:
            return 0.0
        oldest = min(r.arrival_time for r in waiting)
        return max(oldest + self.window - self.clock(), 0.0)
