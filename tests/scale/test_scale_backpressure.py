"""The ingress's backpressure rule over scripted replica answers (the Ray transport is covered by
test_scale_ray.py): a 429 is retried once on another replica, then answered with its Retry-After;
other refusals are not retried; a replica that fails before admitting is retried too."""

from __future__ import annotations

import asyncio

import pytest

from kiln.config import ServeConfig
from kiln.scale.ingress import HedgeOptions, Ingress
from kiln.serving.http.errors import ApiError
from kiln.serving.traffic.flights import Usage


class _Response:
    def __init__(self, items):
        self.items, self.cancelled = list(items), False

    async def __anext__(self):
        if not self.items:
            raise StopAsyncIteration
        return self.items.pop(0)

    def cancel(self):
        self.cancelled = True


class ScriptedReplicas:
    """What a DeploymentHandle's options(stream=True).generate.remote() returns, per replica:
    requests go to the first replica not avoided. A replica whose answer is a failure is dropped
    after it, as Serve's router drops a dead replica's actor (the ingress cannot name it: it
    never said who it was)."""

    def __init__(self, *replicas: tuple[str, tuple]):
        self.replicas, self.calls = list(replicas), []
        self.generate = self

    def options(self, stream: bool):
        assert stream
        return self

    def remote(self, prepared, route=(), avoid=None):
        self.calls.append(avoid)
        name, first = next(((n, f) for n, f in self.replicas if n != avoid), self.replicas[0])
        if first[0] == "failed" and len(self.replicas) > 1:
            self.replicas.remove((name, first))
        return _Response([first, ("usage", Usage(1, 0, 0))])


def _busy(name: str, retry_after: str) -> tuple:
    return ("refused", name, 429, "server busy", None, "ttft_slo", {"Retry-After": retry_after})


@pytest.fixture
def make_ingress(tiny_llama_artifact):
    def make(replicas, hedge=None) -> Ingress:
        return Ingress(replicas, str(tiny_llama_artifact), ServeConfig(), "tiny", hedge)
    return make


def test_a_refusing_replica_is_passed_over_once(make_ingress):
    replicas = ScriptedReplicas(("a", _busy("a", "3")), ("b", ("admitted", "b")))
    ingress = make_ingress(replicas)
    stream = asyncio.run(ingress.open(None, ()))
    assert stream.replica_id == "b" and replicas.calls == [None, "a"]
    assert ingress.registry.get_sample_value("kiln_ingress_retries_total") == 1 and ingress.registry.get_sample_value("kiln_ingress_refused_total") == 0


def test_two_refusals_answer_429_with_the_last_retry_after_and_suspend_hedging(make_ingress):
    replicas = ScriptedReplicas(("a", _busy("a", "3")), ("b", _busy("b", "7")))
    ingress = make_ingress(replicas, HedgeOptions())
    with pytest.raises(ApiError) as e:
        asyncio.run(ingress.open(None, ()))
    assert e.value.status == 429 and e.value.headers["Retry-After"] == "7"
    assert replicas.calls == [None, "a"] and ingress.registry.get_sample_value("kiln_ingress_refused_total") == 1
    assert ingress.hedging.suspended


def test_other_refusals_are_not_retried(make_ingress):
    fault = ("refused", "a", 503, "the engine has faulted", None, "engine_fault", {})
    replicas = ScriptedReplicas(("a", fault), ("b", ("admitted", "b")))
    with pytest.raises(ApiError) as e:
        asyncio.run(make_ingress(replicas).open(None, ()))
    assert e.value.status == 503 and replicas.calls == [None]


def test_a_replica_failing_before_admission_is_retried_then_429(make_ingress):
    dead = ("failed", "the replica failed: ActorDiedError")
    replicas = ScriptedReplicas(("a", dead), ("b", ("admitted", "b")))
    assert asyncio.run(make_ingress(replicas).open(None, ())).replica_id == "b"
    with pytest.raises(ApiError) as e:
        asyncio.run(make_ingress(ScriptedReplicas(("a", dead), ("b", dead))).open(None, ()))
    assert e.value.status == 429 and e.value.headers["Retry-After"] == "1" and e.value.code == "no_replica"
