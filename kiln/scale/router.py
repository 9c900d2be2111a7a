"""The Serve request router: routing.choose() over what replicas report and what this router
sent where.

Each replica's routing stats (record_routing_stats, polled by Serve every
ROUTING_STATS_PERIOD_S) carry its load (a tie-break; see _candidate) and a bounded summary of
the block hashes its prefix cache holds. Between two polls the router also remembers the block
hashes of the requests it routed to each replica, so a conversation's second turn finds its first
turn's replica at once (session affinity comes out of the prefix match).
"""

from __future__ import annotations

import logging
import weakref
from collections import defaultdict
from typing import Container

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from kiln.scale.prefix import SUMMARY_BLOCKS, RecentPrefixes
from kiln.scale.routing import Candidate, Imbalance, choose

ROUTING_STATS_PERIOD_S = 1.0

log = logging.getLogger("kiln.scale.router")

# The routers of this process (the ingress's handle makes one): the ingress's /metrics reads the
# replicas' reported books through them.
ROUTERS: weakref.WeakSet = weakref.WeakSet()


def replica_books() -> dict[str, dict]:
    """replica id -> the books it last reported (up to ROUTING_STATS_PERIOD_S old)."""
    return {rid.unique_id: dict((replica.routing_stats or {}).get("books") or {})
            for router in list(ROUTERS) for rid, replica in router.curr_replicas.items()}


class _Held:
    """A replica's reported hashes or those routed to it since."""

    def __init__(self, reported: Container[int], routed: RecentPrefixes):
        self.reported, self.routed = reported, routed

    def __contains__(self, h) -> bool:
        return h in self.reported or self.routed.has(h)


class KilnPrefixRouter(RequestRouter):
    def initialize_state(self, abs_threshold: float = 4.0, rel_threshold: float = 1.5,
                         memory_blocks: int = SUMMARY_BLOCKS, **_):
        self.imbalance = Imbalance(abs_threshold, rel_threshold)
        # NOTE: through the imported module: Serve may unpickle this class by value, with a copy of
        # this module's globals, and the ingress reads the module's own set.
        import kiln.scale.router

        kiln.scale.router.ROUTERS.add(self)
        self._memory_blocks = memory_blocks
        self._routed: dict[str, RecentPrefixes] = {}
        self._in_flight: dict[str, int] = defaultdict(int)
        self._reported: dict[str, tuple[dict, frozenset]] = {}  # replica -> (its last stats, their hashes)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is None or not candidate_replicas:
            return [candidate_replicas]
        kwargs = pending_request.kwargs or {}
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        candidates = [self._candidate(r) for r in candidate_replicas]
        decision = choose(candidates, tuple(kwargs.get("route") or ()), self.imbalance, kwargs.get("avoid"))
        if log.isEnabledFor(logging.DEBUG):
            log.debug("route: %s (%s, %d blocks matched) among %s", decision.ranks[0], decision.reason,
                      decision.matched, [(c.replica_id, c.load, c.num_prefixes) for c in candidates])
        return [[by_id[i] for i in rank] for rank in decision.ranks]

    def _candidate(self, replica: RunningReplica) -> Candidate:
        rid = replica.replica_id.unique_id
        stats = replica.routing_stats or {}
        routed = self._routed.setdefault(rid, RecentPrefixes(self._memory_blocks))
        # NOTE: the load is this router's own count of requests in flight there: exact for its
        # traffic and never stale. The replica's reported load is up to a stats period old (a
        # request caught in flight at the poll would steer every request for a second); it only
        # breaks ties.
        reported = self._reported_hashes(rid, stats)
        # its cached work: what it reported holding and what this router sent it since, once each
        return Candidate(rid, float(self._in_flight[rid]), _Held(reported, routed), routed.count_with(reported),
                         float(stats.get("load", 0)))

    def _reported_hashes(self, rid: str, stats: dict) -> frozenset:
        cached = self._reported.get(rid)
        if cached is None or cached[0] is not stats:       # a new report: convert it once
            cached = (stats, frozenset(stats.get("hashes") or ()))
            self._reported[rid] = cached
        return cached[1]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        route = (pending_request.kwargs or {}).get("route") or ()
        self._routed.setdefault(replica_id.unique_id, RecentPrefixes(self._memory_blocks)).add(route)

    # NOTE: the in-flight count goes up on sending and down on completion, both by replica: Serve
    # sends before it registers the completion callback, but may call on_request_routed after a
    # request already completed (a request cancelled at once: a hedge's loser), which leaked a
    # count per cancellation when the count went up there.
    def on_send_request(self, replica_id: ReplicaID) -> None:
        super().on_send_request(replica_id)
        self._in_flight[replica_id.unique_id] += 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        rid = replica_id.unique_id
        self._in_flight[rid] = max(self._in_flight[rid] - 1, 0)
