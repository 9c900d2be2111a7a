"""A Serve replica: one kiln engine client behind kiln serve's own admission, flights and
response cache (kiln.serving.http.app.Server), streaming deltas to the ingress.

The replica reports its prefix cache and load to the router (record_routing_stats) and its
admission state to the autoscaler (record_autoscaling_stats). A cancelled request (the ingress
cancelled it: its client hung up, or a hedge won) reaches the generator as a cancellation at its
await; closing the subscription aborts the engine request, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import replace
from pathlib import Path

from kiln.config import RuntimeConfig, ServeConfig
from kiln.scale.messages import refusal
from kiln.scale.prefix import RecentPrefixes
from kiln.serving.http.app import Server, warm_up_requests
from kiln.serving.http.errors import ApiError, bad_request
from kiln.serving.openai.requests import EngineLimits, PreparedRequest

log = logging.getLogger("kiln.scale")

# Engine snapshot fields each replica reports with its routing stats; the ingress's /metrics
# shows them per replica (kiln_replica_*{replica}).
REPLICA_BOOKS = ("num_running", "num_waiting", "kv_blocks_used", "kv_blocks_total", "prefix_cache_queries",
                 "prefix_cache_hits")


class KilnReplica:
    def __init__(self, artifact: str, runtime: RuntimeConfig, config: ServeConfig, model_name: str,
                 slow_replica_delay: float = 0.0, slow_replica_every: int = 1, slow_replica_rank: int | None = 0):
        from ray import serve

        from kiln.runtime.llm import LLM

        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        # A test and benchmark knob (hedging, draining): the replica of that rank (None: every
        # replica) holds every n-th stream this long after admitting it, before its first delta.
        rank = context.rank.rank if context.rank is not None else None
        self.slow = slow_replica_delay if slow_replica_rank is None or rank == slow_replica_rank else 0.0
        self.slow_every, self._streams = max(slow_replica_every, 1), 0
        self.llm = LLM(Path(artifact), runtime)
        self.server = Server(self.llm, config, model_name)
        self.server.start()
        self.recent = RecentPrefixes()
        self.refused, self._refused_reported, self._reported_at = 0, 0, time.monotonic()
        self._warm_up()

    def _warm_up(self) -> None:
        """The server's warm-up requests before Serve routes here (the constructor returns only
        then), so admission predicts from a measured prefill rate."""
        for request in warm_up_requests(self.llm, self.server.limits.max_model_len):
            self.server.client.complete([request])
        self.server.ready = True
        log.info("replica %s ready", self.replica_id)

    async def limits(self) -> EngineLimits:
        return self.server.limits

    async def generate(self, prepared: PreparedRequest, route: tuple[int, ...] = (), avoid: str | None = None):
        """The stream of messages.py. `route` (the prompt's block hashes) and `avoid` are read by
        the router; `route` is also remembered here for the routing summary."""
        try:
            if self.server.client.fault is not None:
                raise ApiError(503, f"the engine has faulted: {self.server.client.fault}", code="engine_fault")
            prepared = await self._bound(prepared)
            sub = self.server.generations.open(prepared)
        except ApiError as e:
            self.refused += e.status == 429
            yield refusal(self.replica_id, e)
            return
        except ValueError as e:               # a constraint the grammar engine refuses (GrammarError)
            yield refusal(self.replica_id, bad_request(str(e)))
            return
        except Exception:
            log.exception("replica %s: a request failed before it started", self.replica_id)
            yield refusal(self.replica_id, ApiError(500, "internal error; the replica log has the details"))
            return
        self.recent.add(route)
        try:
            yield ("admitted", self.replica_id)
            self._streams += 1
            if self.slow and self._streams % self.slow_every == 0:
                await asyncio.sleep(self.slow)
            async for delta in sub.deltas():
                yield ("delta", delta)
            yield ("usage", sub.usage)
        except Exception as e:                # the engine failed mid-step, or refused the request
            yield ("failed", f"{type(e).__name__}: {e}")
        finally:
            sub.close()                       # a cancellation lands here too: the KV is freed

    async def _bound(self, prepared: PreparedRequest) -> PreparedRequest:
        """The request with its constraint compiled again (messages.portable() left it out), on the
        server's preparation threads: compiling (and the first constraint's grammar tokenizer, about
        half a second) never runs on this replica's event loop, where every stream is relayed. Its
        place among the preparing is bounded as kiln serve's is (429 past MAX_PREPARING)."""
        spec = prepared.params.structured
        if spec is None or spec.compiled is not None:
            return prepared
        with self.server.preparing():
            params = await self.server.off_loop(self.llm.bind, prepared.params)
        return replace(prepared, params=params)

    async def record_routing_stats(self) -> dict:
        s = self.server.client.snapshot
        return {"load": self.server.generations.num_flights,
                "hashes": self.recent.summary(s.prefix_cache.hashes),
                "books": {name: getattr(s, name) for name in REPLICA_BOOKS}}

    async def record_autoscaling_stats(self) -> dict:
        admission, now = self.server.generations.admission, time.monotonic()
        refused = self.refused - self._refused_reported
        rate = refused / max(now - self._reported_at, 1e-3)
        self._refused_reported, self._reported_at = self.refused, now
        return {"predicted_ttft": admission.predicted_ttft(0), "ttft_slo": self.server.config.admission.ttft_slo,
                "waiting_tokens": admission.pending_tokens, "prefill_tps": admission.prefill_tokens_per_second,
                "refused_per_s": rate}

    async def state(self, route: tuple[int, ...] = (), avoid: str | None = None) -> dict:
        """This replica's books now (the router's `avoid` picks a replica: tests ask each one)."""
        s = self.server.client.snapshot
        return {"replica": self.replica_id, "pid": os.getpid(), "kv_blocks_used": s.kv_blocks_used,
                "running": s.num_running, "waiting": len(self.server.generations.admission.waiting),
                "flights": self.server.generations.num_flights, "finished": dict(s.finished)}

    async def check_health(self) -> None:
        """Serve replaces a replica whose engine loop faulted (it is never restarted in place)."""
        if self.server.client.fault is not None:
            raise RuntimeError(f"the engine has faulted: {self.server.client.fault}")

    def __del__(self):
        # Serve calls this after the drain (graceful_shutdown_timeout_s): streams have finished.
        server = getattr(self, "server", None)
        if server is not None:
            server.stop()
