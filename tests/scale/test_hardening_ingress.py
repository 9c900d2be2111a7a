"""Hardening, second round (issue 45), the Ray Serve path's parts that need no cluster: the hedge
race and the ingress's opening when the client leaves (item 7), a refused constraint's admission
ticket (item 8), the ingress's request options (item 9) and its /ready and keyed endpoints
(item 10). The real Ingress over the tiny model's tokenizer, replicas scripted as in
test_scale_backpressure.py; the cluster's side is test_hardening_ray.py."""

from __future__ import annotations

import asyncio

import pytest
from starlette.testclient import TestClient

from kiln import LLM, RuntimeConfig
from kiln.config import AdmissionConfig, ServeConfig
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.structured import StructuredOutput
from kiln.scale.hedge import HedgePolicy, race
from kiln.scale.ingress import Ingress, create_ingress_app
from kiln.serving.http import app as app_module
from kiln.serving.openai.requests import PreparedRequest, RequestOptions


class Waiting:
    """A stream that never reaches its first token until cancelled."""

    def __init__(self, name: str):
        self.replica_id, self.cancelled = name, False

    async def first_token(self) -> None:
        await asyncio.Event().wait()

    def cancel(self) -> None:
        self.cancelled = True


# ---- 7. a hedged duplicate never outlives a client that left ----------------------------------

def test_a_race_cancelled_after_the_hedge_opened_cancels_both_streams():
    primary, opened = Waiting("a"), []

    async def open_hedge(avoid):
        opened.append(Waiting("b"))
        return opened[-1]

    async def main():
        task = asyncio.ensure_future(race(primary, open_hedge, HedgePolicy(fraction=1.0, floor=0.01)))
        while not opened:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.01)            # both streams are racing for their first token
        task.cancel()                        # the client left
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert primary.cancelled and opened[0].cancelled


def test_a_race_cancelled_before_any_hedge_cancels_the_primary():
    primary = Waiting("a")

    async def main():
        task = asyncio.ensure_future(race(primary, None, HedgePolicy(fraction=1.0, floor=10.0)))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert primary.cancelled


class _Hanging:
    """A replica's streaming response whose first message never comes."""

    def __init__(self):
        self.cancelled = False

    async def __anext__(self):
        await asyncio.Event().wait()

    def cancel(self):
        self.cancelled = True


class _Replicas:
    def __init__(self):
        self.responses: list[_Hanging] = []
        self.generate, self.limits = self, _FailingLimits()

    def options(self, stream: bool):
        return self

    def remote(self, prepared, route=(), avoid=None):
        self.responses.append(_Hanging())
        return self.responses[-1]


class _FailingLimits:
    async def _fail(self):
        raise RuntimeError("ActorUnavailableError: actor 5f3c9a01 at 10.1.2.3:40123 (SECRET-NODE-NAME)")

    def remote(self):
        return self._fail()


@pytest.fixture(scope="module")
def ingress_of(tiny_llama_artifact):
    def make(config: ServeConfig = ServeConfig(), **kw) -> Ingress:
        return Ingress(_Replicas(), str(tiny_llama_artifact), config, "tiny", **kw)
    return make


def test_an_opening_cancelled_while_waiting_for_the_replica_cancels_that_stream(ingress_of):
    """The hedge's own opening (open_hedge) cancelled mid-way: the duplicate it had sent is cancelled."""
    ingress = ingress_of()

    async def main():
        task = asyncio.ensure_future(ingress.open(None, ()))
        while not ingress.replicas.responses:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert [r.cancelled for r in ingress.replicas.responses] == [True]


# ---- 8. an exception after admission gives the ticket back ----------------------------------

def test_a_constraint_refused_after_admission_leaves_no_ticket_waiting(tiny_llama_artifact):
    llm = LLM(tiny_llama_artifact, RuntimeConfig(kv_cache_memory=16 << 20, threads=1))
    server = app_module.Server(llm, ServeConfig(admission=AdmissionConfig(ttft_slo=0)), "tiny")
    server.start()
    try:
        bad = SamplingParams(max_tokens=2, structured=StructuredOutput.regex("("))    # not compiled yet
        with pytest.raises(ValueError):
            server.generations.open(PreparedRequest("completion", (1, 2, 3), bad))
        assert not server.generations.admission.waiting and server.generations.num_flights == 0
    finally:
        server.stop()


# ---- 9. the ingress prepares with kiln serve's options ---------------------------------------

def test_the_ingress_prepares_with_the_options_kiln_serve_would(ingress_of, tiny_llama_artifact):
    config = ServeConfig(admission=AdmissionConfig(ttft_slo=0), strict_api=True, tool_call_parser="mistral",
                         api_keys=(("alice", "k1"),), key_priorities=(("alice", -5, 5),))
    ingress = ingress_of(config)
    llm = LLM(tiny_llama_artifact, RuntimeConfig(kv_cache_memory=16 << 20, threads=1))
    try:
        server = app_module.Server(llm, config, "tiny")
        for key in ("alice", None):
            assert ingress.options(key) == server.options(key)
        assert ingress.options("alice") == RequestOptions(False, "api-key:alice", True, "mistral", (-5, 5))
    finally:
        llm.client.shutdown()


# ---- 10. the ingress's /ready and keyed endpoints --------------------------------------------

def test_the_ingress_ready_probe_never_shows_the_exception_and_metrics_need_the_key(ingress_of):
    ingress = ingress_of(ServeConfig(admission=AdmissionConfig(ttft_slo=0), api_key="k-secret"))
    client = TestClient(create_ingress_app(ingress), base_url="http://127.0.0.1")
    ready = client.get("/ready")
    assert ready.status_code == 503
    assert "SECRET" not in ready.text and "10.1.2.3" not in ready.text and "Actor" not in ready.text
    assert client.get("/health").status_code == 200          # the probes stay public by default
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", headers={"Authorization": "Bearer k-secret"}).status_code == 200
    public = ingress_of(ServeConfig(admission=AdmissionConfig(ttft_slo=0), api_key="k-secret",
                                    public_endpoints=("/health", "/metrics")))
    assert TestClient(create_ingress_app(public), base_url="http://127.0.0.1").get("/metrics").status_code == 200
