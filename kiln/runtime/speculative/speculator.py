"""The Speculator: which decoding requests get proposals this step, how many, from which
proposer, and what became of them. The scheduler asks it once per step and tells it each
verification's outcome; it never touches an engine itself (a draft proposer does, behind the
Proposer protocol)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kiln.runtime.request import Request
from kiln.runtime.speculative.adaptive import BATCHED_OFF_RATE, OFF_RATE, Acceptance, load_limit


class Proposer(Protocol):
    def propose(self, requests: Sequence[tuple[Request, int]]) -> dict[str, list[int]]:
        """At most k guessed next tokens for each (request, k); requests without a guess are left out."""

    def forget(self, request_id: str) -> None:
        """The request finished: drop what was kept for it."""


@dataclass
class SpeculationStats:
    verifications: int = 0      # (request, step) pairs that verified proposals
    proposed: int = 0           # tokens proposed and verified
    accepted: int = 0           # of those, kept

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


class Speculator:
    def __init__(self, proposer: Proposer, num_speculative_tokens: int, max_step_tokens: int,
                 max_decodes: int | None = None):
        self.proposer = proposer
        self.k_max, self.max_step_tokens, self.max_decodes = num_speculative_tokens, max_step_tokens, max_decodes
        self.stats = SpeculationStats()
        self._acceptance: dict[str, Acceptance] = {}
        self._off_rate = OFF_RATE       # the bar of the step being verified (set when it was proposed)

    def propose(self, decoding: Sequence[Request]) -> dict[str, list[int]]:
        """Proposals for the requests decoding this step (request id -> tokens)."""
        limit = load_limit(len(decoding), self.k_max, self.max_step_tokens, self.max_decodes)
        self._off_rate = OFF_RATE if len(decoding) <= 1 else BATCHED_OFF_RATE
        if limit == 0:
            return {}
        asks = []
        for request in decoding:
            if not _eligible(request):
                continue
            # NOTE: never past max_tokens: the step emits the kept proposals plus one token.
            room = request.max_tokens - request.num_output_tokens - 1
            k = min(limit, room, self._record(request.request_id).proposals(self.k_max))
            if k > 0:
                asks.append((request, k))
        return self.proposer.propose(asks) if asks else {}

    def observe(self, request_id: str, proposed: int, accepted: int) -> None:
        self.stats.verifications += 1
        self.stats.proposed += proposed
        self.stats.accepted += accepted
        self._record(request_id).observe(proposed, accepted, self._off_rate)

    def forget(self, request_id: str) -> None:
        self._acceptance.pop(request_id, None)
        self.proposer.forget(request_id)

    def _record(self, request_id: str) -> Acceptance:
        record = self._acceptance.get(request_id)
        if record is None:
            record = self._acceptance[request_id] = Acceptance()
        return record


def _eligible(request: Request) -> bool:
    """Requests that ask for logprobs or follow a grammar decode one token at a time: a step's
    delta carries one logprobs entry, and a grammar's mask would have to advance per proposal."""
    params = request.sampling_params
    return params.logprobs is None and params.structured is None
