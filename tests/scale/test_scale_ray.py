"""kiln on a real local Ray cluster (loopback, dashboard off): two replicas of a tiny model behind
the ingress. One module-scoped cluster: starting Ray on two cores takes most of this module's time."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

ray = pytest.importorskip("ray", reason="the scale extra: pip install -e '.[scale]'")
from ray import serve  # noqa: E402

from kiln.config import AdmissionConfig, ResponseCacheConfig, RuntimeConfig, ServeConfig  # noqa: E402
from kiln.scale.app import APP_NAME, ScaleOptions, application  # noqa: E402
from kiln.scale.ingress import REPLICA_HEADER  # noqa: E402

DEADLINE = 30.0       # seconds a poll waits for the cluster to catch up


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tiny_llama_artifact):
    port = _free_port()
    # logical CPUs: two replicas of one CPU, two hedging ones of half a CPU (test_hedged_requests...)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        config = ServeConfig(port=port, admission=AdmissionConfig(ttft_slo=0),
                             response_cache=ResponseCacheConfig(enabled=False),
                             served_model_name="tiny-llama")
        app = application(tiny_llama_artifact, RuntimeConfig(kv_cache_memory=32 << 20), config,
                          ScaleOptions(replicas=2, replica_cpus=1, drain_timeout=5, replica_header=True))
        serve.run(app, name=APP_NAME, route_prefix="/")
        yield f"http://127.0.0.1:{port}", serve.get_deployment_handle("kiln-replica", app_name=APP_NAME)
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def hedged(cluster, tiny_llama_artifact):
    """A second application on the same cluster: hedging on, its rank-0 replica 3 s slow."""
    url, _ = cluster
    config = ServeConfig(admission=AdmissionConfig(ttft_slo=0), response_cache=ResponseCacheConfig(enabled=False),
                         served_model_name="tiny-llama")
    options = ScaleOptions(replicas=2, replica_cpus=0.5, drain_timeout=5, hedge=True, hedge_fraction=1.0,
                           hedge_floor=0.3, slow_replica_delay=SLOW, replica_header=True)
    serve.run(application(tiny_llama_artifact, RuntimeConfig(kv_cache_memory=32 << 20, threads=1), config,
                          options), name="hedge", route_prefix="/hedge")
    yield f"{url}/hedge", serve.get_deployment_handle("kiln-replica", app_name="hedge")
    serve.delete("hedge")


SLOW = 3.0       # seconds the slow replica holds each stream before its first token


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def _replica_of(url: str, prompt: str, **body) -> str:
    r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 2, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.headers[REPLICA_HEADER]


def _states(handle) -> dict[str, dict]:
    """Each replica's books: the router's `avoid` sends the second call to the other replica."""
    first = handle.state.remote().result()
    second = handle.state.remote(avoid=first["replica"]).result()
    return {s["replica"]: s for s in (first, second)}


def test_the_openai_client_streams_through_the_ingress(cluster):
    url, _ = cluster
    client = _client(url)
    stream = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=6, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})     # random weights may say EOS
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == 6
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    reply = client.completions.create(model="tiny-llama", prompt="hello there", max_tokens=3,
                                      extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 3 and reply.choices[0].finish_reason == "length"
    assert [m.id for m in client.models.list().data] == ["tiny-llama"]
    # a grammar does not pickle: the request crosses without it and the replica compiles it again
    constrained = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4, extra_body={"guided_choice": ["yes", "no"]})
    assert constrained.choices[0].message.content in ("yes", "no")
    # kiln serve's own validation and error bodies
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-llama", prompt="x", max_tokens=0)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert httpx.get(f"{url}/ready").json()["status"] == "ready"


def test_a_shared_prefix_lands_on_one_replica_and_distinct_ones_spread(cluster):
    url, _ = cluster
    system = "You are a careful assistant who answers in one short sentence. " * 8     # many blocks
    same = {_replica_of(url, f"{system} Question {i}: what is {i} plus {i}?") for i in range(6)}
    assert len(same) == 1, f"one shared prefix went to {same}"
    spread = {_replica_of(url, f"Topic {i} " * 40) for i in range(6)}
    assert len(spread) == 2, "distinct prefixes all went to one replica"
    # prompts that open with one template header (a block or two every prompt shares) spread too
    header = "<|im_start|>system\nYou are a helpful assistant.\n"
    opened = {_replica_of(url, header + f"Subject {i} " * 40) for i in range(6)}
    assert len(opened) == 2, "prompts sharing only a template header all went to one replica"
    metrics = httpx.get(f"{url}/metrics").text
    routed = [line for line in metrics.splitlines() if line.startswith("kiln_ingress_requests_total{")]
    assert len(routed) == 2 and all(f'replica="{r}"' in metrics for r in spread)
    # the cluster view: each replica's engine books with a replica label, as it last reported them
    (holder,) = same
    deadline, hits = time.monotonic() + DEADLINE, {}
    while time.monotonic() < deadline and not hits.get(holder):
        hits = {line.split('"')[1]: float(line.split()[-1]) for line in httpx.get(f"{url}/metrics").text.splitlines()
                if line.startswith("kiln_replica_prefix_cache_hits_total{")}
        time.sleep(0.2)
    assert set(hits) == spread and hits[holder] > 0       # the shared prefix's replica reports its hits
    # deploy/grafana/kiln-ray.json's replica view queries only what the ingress exports
    exported = {line.split("{")[0].split()[0] for line in httpx.get(f"{url}/metrics").text.splitlines()
                if line and not line.startswith("#")}
    assert _dashboard_metrics(DASHBOARD) <= exported, _dashboard_metrics(DASHBOARD) - exported


DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "kiln-ray.json"


def _dashboard_metrics(path: Path) -> set[str]:
    """The metric names the dashboard's PromQL selects (each query parsed; Grafana's variables set)."""
    import promql_parser

    def names(node) -> set[str]:
        if isinstance(node, promql_parser.VectorSelector):
            return {node.name}
        found = set()
        for attr in ("expr", "lhs", "rhs", "args", "vector_selector", "param"):
            child = getattr(node, attr, None)
            for c in child if isinstance(child, list) else [child]:
                if c is not None and not isinstance(c, (str, int, float)):
                    found |= names(c)
        return found

    dashboard, found = json.loads(path.read_text()), set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"].replace("$__rate_interval", "1m").replace("$instance", ".*")
            found |= names(promql_parser.parse(expr))
    assert len(found) >= 8
    return found


def test_a_client_hang_up_cancels_the_replica_request_and_frees_its_kv(cluster):
    url, handle = cluster
    before = _states(handle)
    context = httpx.get(f"{url}/v1/models").json()["data"][0]["max_model_len"]
    body = {"prompt": "Count slowly: " * 4, "max_tokens": context - 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        replica = r.headers[REPLICA_HEADER]
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")          # it is generating on that replica
    aborted_before = before[replica]["finished"].get("abort", 0)
    deadline, state = time.monotonic() + DEADLINE, None
    while time.monotonic() < deadline:
        state = _states(handle)[replica]
        if state["finished"].get("abort", 0) > aborted_before and state["kv_blocks_used"] == 0:
            break
        time.sleep(0.2)
    assert state["finished"].get("abort", 0) == aborted_before + 1, state
    assert state["kv_blocks_used"] == 0 and state["flights"] == 0 and state["running"] == 0


def test_hedged_requests_clip_a_slow_replica(hedged):
    url, handle = hedged
    answered = [_replica_of(url, f"Hedge topic {i} " * 20) for i in range(4)]
    metrics = {line.split()[0]: float(line.split()[1]) for line in httpx.get(f"{url}/metrics").text.splitlines()
               if line.startswith("kiln_hedges_")}
    sent = metrics["kiln_hedges_sent_total"]
    # distinct prefixes spread over both replicas, so some went to the slow one first and were
    # hedged; the fast replica's duplicate won every time and the slow stream was cancelled
    assert sent >= 1 and metrics["kiln_hedges_won_total"] == sent == metrics["kiln_hedges_cancelled_total"]
    assert len(set(answered)) == 1, answered             # every answer came from the fast replica
    states = _states(handle)
    slow = next(r for r in states if r != answered[0])
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline and states[slow]["flights"]:
        time.sleep(0.2)
        states = _states(handle)
    assert states[slow]["flights"] == 0 and states[slow]["kv_blocks_used"] == 0


def _running(app: str) -> int:
    return serve.status().applications[app].deployments["kiln-replica"].replica_states.get("RUNNING", 0)


def test_autoscaling_on_kilns_signals_adds_a_replica_while_refusing_and_removes_it_when_idle(
        cluster, tiny_llama_artifact):
    url, _ = cluster
    # an objective no request can meet, refused at the objective itself (the strict mode, which needs
    # no evidence first): every request is refused (429), so the policy asks for one more
    config = ServeConfig(admission=AdmissionConfig(ttft_slo=1e-4, ttft_refuse_factor=1),
                         response_cache=ResponseCacheConfig(enabled=False), served_model_name="tiny-llama")
    options = ScaleOptions(replicas=1, max_replicas=2, replica_cpus=0.5, upscale_delay=1, downscale_delay=2)
    serve.run(application(tiny_llama_artifact, RuntimeConfig(kv_cache_memory=32 << 20, threads=1), config,
                          options), name="auto", route_prefix="/auto")
    try:
        assert _running("auto") == 1
        deadline, statuses = time.monotonic() + 60, set()
        while time.monotonic() < deadline and _running("auto") < 2:
            r = httpx.post(f"{url}/auto/v1/completions", json={"prompt": "x " * 50, "max_tokens": 2}, timeout=30)
            statuses.add(r.status_code)
            time.sleep(0.2)
        assert statuses == {429} and _running("auto") == 2
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and _running("auto") > 1:     # idle now: pressure 0
            time.sleep(0.5)
        assert _running("auto") == 1
    finally:
        serve.delete("auto")


def test_scale_down_drains_the_streams_of_the_replica_it_removes(cluster, tiny_llama_artifact):
    url, _ = cluster
    config = ServeConfig(admission=AdmissionConfig(ttft_slo=0), response_cache=ResponseCacheConfig(enabled=False),
                         served_model_name="tiny-llama")
    runtime = RuntimeConfig(kv_cache_memory=32 << 20, threads=1)

    def deploy(replicas: int) -> None:       # every stream is held HOLD s before its first token
        options = ScaleOptions(replicas=replicas, replica_cpus=0.5, drain_timeout=30, slow_replica_delay=HOLD,
                               slow_replica_rank=None, replica_header=True)
        serve.run(application(tiny_llama_artifact, runtime, config, options), name="drain", route_prefix="/drain")

    deploy(2)
    results, opened, go = {}, [threading.Event(), threading.Event()], threading.Event()

    def read(i: int) -> None:
        body = {"prompt": f"Drain {i} " * 10, "max_tokens": 8, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/drain/v1/completions", json=body, timeout=120) as r:
            opened[i].set()
            go.wait(60)
            results[i] = (r.headers.get(REPLICA_HEADER), [line for line in r.iter_lines() if line])

    try:
        readers = [threading.Thread(target=read, args=(i,)) for i in range(2)]
        # NOTE: one after the other: the second is routed once the router counts the first in
        # flight, so the least-loaded rule puts it on the other replica (two at once could race)
        for t, was_opened in zip(readers, opened):
            t.start()
            assert was_opened.wait(60)
        go.set()                                              # both streams are open on a replica
        deploy(1)                                             # one replica goes while its stream is held
        for t in readers:
            t.join(timeout=120)
        assert _running("drain") == 1
        assert len({replica for replica, _ in results.values()}) == 2        # one stream was on each
        for replica, lines in results.values():
            assert lines[-1] == "data: [DONE]" and not any('"error"' in line for line in lines), lines[-2:]
    finally:
        serve.delete("drain")


HOLD = 6.0


def test_a_killed_replica_ends_its_streams_with_an_error_and_the_cluster_recovers(cluster):
    """Last in the module: it kills a replica's process (SIGKILL) mid-stream."""
    url, handle = cluster
    states = _states(handle)
    context = httpx.get(f"{url}/v1/models").json()["data"][0]["max_model_len"]
    body = {"prompt": "Count slowly: " * 4, "max_tokens": context - 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        victim = r.headers[REPLICA_HEADER]
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        os.kill(states[victim]["pid"], signal.SIGKILL)
        rest = [line for line in lines if line]               # ends: httpx's timeout would raise
    assert rest and rest[-1] != "data: [DONE]", rest[-3:]
    assert rest[-1].startswith('data: {"error"'), rest[-1]         # an SSE error event, never a hang
    # new requests are served meanwhile (a request routed to the dead replica is retried once)
    for i in range(4):
        assert _replica_of(url, f"after the fault {i} " * 5) != victim
    deadline, after = time.monotonic() + 90, {}
    while time.monotonic() < deadline and len(after) < 2:     # Serve starts a replacement
        time.sleep(0.5)
        after = _states(handle)                               # once the handle's router knows it
    assert len(after) == 2 and victim not in after, after.keys()
    assert all(s["kv_blocks_used"] == 0 and s["flights"] == 0 for s in after.values())
