"""Where a prepared request gets its tokens: the response cache, an identical request already in
flight, or a new engine request (the only one that passes admission control)."""

from __future__ import annotations

import uuid
from typing import Hashable

from kiln.serving.traffic.admission import Admission, Ticket
from kiln.serving.traffic.flights import Flight, Subscription
from kiln.serving.http.metrics import ServerMetrics
from kiln.serving.openai.requests import PreparedRequest
from kiln.serving.cache.response_cache import ResponseCache

CACHEABLE_FINISH_REASONS = ("stop", "length")    # never a timeout's or an abort's partial answer


class Generations:
    def __init__(self, client, admission: Admission, metrics: ServerMetrics,
                 cache: ResponseCache | None, timeout: float | None):
        self.client, self.admission, self.metrics = client, admission, metrics
        self.cache, self.timeout = cache, timeout
        self._in_flight: dict[Hashable, Flight] = {}     # shareable flights, by cache key
        self.num_flights = 0                              # engine requests this server has open

    def open(self, prepared: PreparedRequest, after=None) -> Subscription:
        """A subscription to the request's deltas; raises ApiError(429) when admission refuses.
        after: an asyncio.Event the engine request waits for (admitted now, submitted then)."""
        key = prepared.cache_key if self.cache is not None and prepared.deterministic else None
        shared = self._shared(key) if key is not None else None
        if shared is not None:
            return shared
        ticket = self.admission.admit_prompt(prepared.prompt_ids, prepared.params.cache_salt)
        try:
            request = self.client.make_request(prepared.prompt_ids, prepared.params, f"kiln-{uuid.uuid4().hex}")
        except BaseException:       # a constraint the grammar engine refuses: the ticket is not left waiting
            ticket.release()
            raise
        flight = Flight(self.client, request, self.timeout, on_first_token=ticket.first_token,
                        on_done=lambda f: self._landed(f, ticket, key), after=after)
        if key is not None:
            self._in_flight[key] = flight
        self.num_flights += 1
        # NOTE: subscribe before the task first runs, so the flight never sees zero listeners early.
        return flight.start().subscribe()

    def _shared(self, key: Hashable) -> Subscription | None:
        recording = self.cache.get(key)
        if recording is not None:
            self.metrics.cache_hits.labels("stored").inc()
            return recording.subscribe()
        flight = self._in_flight.get(key)
        if flight is not None and flight.joinable:
            self.metrics.cache_hits.labels("in_flight").inc()
            return flight.subscribe()
        return None

    def _landed(self, flight: Flight, ticket: Ticket, key: Hashable | None) -> None:
        ticket.release()
        self.num_flights -= 1
        if key is not None and self._in_flight.get(key) is flight:
            del self._in_flight[key]
        if flight.cancelled:
            self.metrics.aborted.inc()
        if flight.error is None:
            self.metrics.observe_request(flight.request, flight.usage.completion_tokens)
        if key is not None and flight.finish_reason in CACHEABLE_FINISH_REASONS:
            self.cache.put(key, flight.recording())
