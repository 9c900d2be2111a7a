"""Which replica gets a request: the one holding the longest cached prefix of its prompt, unless
that replica is overloaded past the stated imbalance, or the prefix is too small a part of the prompt
to be worth keeping it there; otherwise the least-loaded one, and among equally loaded replicas the
one holding the least cached work, so prompts that have no home spread over idle replicas.

Pure logic over plain values (the Serve router in router.py feeds it), so it tests without Ray.

The imbalance rule (SGLang's cache-aware router states the same two thresholds): the prefix
holder is passed over when its load exceeds the least-loaded replica's by more than
`abs_threshold` requests AND by more than `rel_threshold` times. Both must hold: at low load a
difference of a request or two is worth a cache hit (a long prompt's prefill costs more than a
short wait); at high load only a real skew is.
"""

from __future__ import annotations

import hashlib
from collections.abc import Container, Sequence
from dataclasses import dataclass, field

from kiln.scale.prefix import matched_blocks


# A cached prefix counts when it covers at least this part of the prompt's routed blocks. A chat
# template's preamble (a system header, a date line) is the first block or two of every prompt: the
# first replica to serve one holds it, and counting that as a home sent every new prompt there while
# the other replicas idled. Ray's prefix-affinity router applies a threshold of the same kind.
MIN_MATCH_FRACTION = 0.2


@dataclass(frozen=True)
class Imbalance:
    abs_threshold: float = 4.0          # requests
    rel_threshold: float = 1.5          # times the least-loaded replica's load

    def __post_init__(self):
        if self.abs_threshold < 0 or self.rel_threshold < 1:
            raise ValueError("the imbalance needs abs_threshold >= 0 and rel_threshold >= 1, "
                             f"got {self.abs_threshold} and {self.rel_threshold}")

    def overloaded(self, load: float, least: float) -> bool:
        return load - least > self.abs_threshold and load > self.rel_threshold * least


@dataclass(frozen=True)
class Candidate:
    replica_id: str
    load: float                                  # requests running or waiting there
    held: Container[int] = frozenset()           # block hashes it holds (reported or remembered)
    num_prefixes: int = 0                        # cached blocks it holds (reported or routed): its cached work
    reported_load: float = 0.0                   # the replica's own report (may be stale): ties only


@dataclass(frozen=True)
class Decision:
    ranks: list[list[str]]                       # most preferred first, as Serve's router takes them
    matched: int = 0                             # leading blocks the chosen replica holds
    reason: str = "least_loaded"                 # prefix | least_loaded | overloaded
    candidates: tuple[str, ...] = field(default=(), repr=False)


def choose(candidates: Sequence[Candidate], hashes: Sequence[int], imbalance: Imbalance = Imbalance(),
           avoid: str | None = None) -> Decision:
    """Ranks for one request. `avoid`: a replica that just refused it or that a hedge must not
    use; passed over whenever another replica exists."""
    if not candidates:
        raise ValueError("no replica to choose from")
    pool = [c for c in candidates if c.replica_id != avoid] or list(candidates)
    by_load = sorted(pool, key=lambda c: (c.load, c.num_prefixes, c.reported_load, _spread(hashes, c.replica_id)))
    least = by_load[0].load
    best, best_len = None, 0
    for c in by_load:                             # ties go to the less loaded
        n = matched_blocks(hashes, c.held)
        if n > best_len:
            best, best_len = c, n
    if best_len < MIN_MATCH_FRACTION * len(hashes):
        best, best_len = None, 0                  # too little of the prompt: no home
    reason = "least_loaded"
    if best is not None and not imbalance.overloaded(best.load, least):
        first, reason = best, "prefix"
    else:
        first = by_load[0]
        reason = "overloaded" if best is not None else reason
    rest = [c.replica_id for c in by_load if c is not first]
    ranks = [[first.replica_id]] + ([rest] if rest else [])
    return Decision(ranks, best_len if first is best else 0, reason, tuple(c.replica_id for c in pool))


def _spread(hashes: Sequence[int], replica_id: str) -> tuple[int, str]:
    """The last tie-break, between replicas equal in load and cached work: a hash of the prompt's
    routed blocks with the replica (rendezvous hashing). A prompt ranks the replicas the same way
    every time, distinct prompts rank them differently, so they do not all go to the lowest id. The
    last block's chain hash names every block before it: the first would be the same for all
    prompts that open with one chat template's header."""
    last = hashes[-1] if hashes else 0
    digest = hashlib.blake2b(f"{last}:{replica_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big"), replica_id
