"""Hardening, second round (issue 45) on a real local Ray cluster: one replica of the tiny model
behind the ingress, with an API key, --strict-api, a chat template with <think> blocks and
--tool-call-parser. A constraint compiled off the replica's event loop and refused as a 400
(item 8), kiln serve's request options through the ingress (item 9), no replica id in the answers'
headers and /metrics behind the key (item 10). Ingress-only parts: test_hardening_ingress.py."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

ray = pytest.importorskip("ray", reason="the scale extra: pip install -e '.[scale]'")
from ray import serve  # noqa: E402

from kiln.config import AdmissionConfig, ResponseCacheConfig, RuntimeConfig, ServeConfig  # noqa: E402
from kiln.runtime.sampling_params import SamplingParams  # noqa: E402
from kiln.runtime.structured import StructuredOutput  # noqa: E402
from kiln.scale.app import ScaleOptions, application  # noqa: E402
from kiln.scale.ingress import REPLICA_HEADER  # noqa: E402
from kiln.serving.openai.requests import PreparedRequest  # noqa: E402
from kiln_server import free_port  # noqa: E402

KEY = "hardening-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
THINK_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                  "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
                  "<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}")


@pytest.fixture(scope="module")
def cluster(tiny_llama_artifact, tmp_path_factory):
    template = tmp_path_factory.mktemp("think") / "chat.jinja"
    template.write_text(THINK_TEMPLATE)
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        config = ServeConfig(port=port, admission=AdmissionConfig(ttft_slo=0),
                             response_cache=ResponseCacheConfig(enabled=False),
                             served_model_name="tiny-llama",
                             api_key=KEY, strict_api=True, chat_template=template, tool_call_parser="mistral")
        app = application(tiny_llama_artifact, RuntimeConfig(kv_cache_memory=16 << 20, threads=1), config,
                          ScaleOptions(replicas=1, replica_cpus=1, drain_timeout=5))
        serve.run(app, name="hardening", route_prefix="/")
        yield f"http://127.0.0.1:{port}", serve.get_deployment_handle("kiln-replica", app_name="hardening")
    finally:
        serve.shutdown()
        ray.shutdown()


def _chat(url: str, **extra) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "ignore_eos": True, **extra}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=AUTH, timeout=60)


# ---- 8. constraints on the replica ----------------------------------------------------------

def _large_schema(properties: int) -> StructuredOutput:
    """A schema the grammar engine takes about a second or more to compile on this machine."""
    return StructuredOutput.json_schema({
        "type": "object", "required": [f"p{i}" for i in range(properties)],
        "properties": {f"p{i}": {"type": "string", "pattern": "[a-z]{%d,%d}x[0-9]{2,%d}" % (i % 5, i % 7 + 5, i % 9 + 3)}
                       for i in range(properties)}})


def test_a_constraint_compiles_off_the_replicas_event_loop(cluster):
    """The replica compiles a request's constraint again (it does not pickle). While a large one
    compiles, the replica's other calls (every stream's relay) are answered at once."""
    _, handle = cluster
    handle.state.remote().result()                        # the replica is up and answering
    prepared = PreparedRequest("completion", (1, 2, 3, 4), SamplingParams(max_tokens=1, structured=_large_schema(8000)))
    first: list = []

    def read() -> None:
        for item in handle.options(stream=True).generate.remote(prepared):
            first.append(item)
            break

    reader = threading.Thread(target=read)
    started = time.monotonic()
    reader.start()
    slowest = 0.0
    while not first and time.monotonic() - started < 60:
        t = time.monotonic()
        handle.state.remote().result()
        slowest = max(slowest, time.monotonic() - t)
    reader.join(60)
    compiled_in = time.monotonic() - started
    assert first and first[0][0] == "admitted", first
    assert compiled_in > 1.0, f"the schema compiled in {compiled_in:.2f} s: too fast to show a stall"
    assert slowest < 0.5 * compiled_in, f"a call waited {slowest:.2f} s while the constraint compiled"


def test_a_constraint_the_replica_refuses_is_a_400_and_leaves_nothing_waiting(cluster):
    _, handle = cluster
    bad = PreparedRequest("completion", (1, 2, 3), SamplingParams(max_tokens=2, structured=StructuredOutput.regex("(")))
    items = list(handle.options(stream=True).generate.remote(bad))
    assert len(items) == 1 and items[0][0] == "refused" and items[0][2] == 400, items
    state = handle.state.remote().result()
    assert state["waiting"] == 0 and state["flights"] == 0 and state["kv_blocks_used"] == 0


# ---- 9. kiln serve's options through the ingress --------------------------------------------

def test_the_ingress_applies_strict_api_and_the_templates_reasoning(cluster):
    url, _ = cluster
    unknown = _chat(url, no_such_field=1)
    assert unknown.status_code == 400, unknown.text                 # --strict-api refuses it
    thinking = _chat(url)
    assert thinking.status_code == 200, thinking.text
    message = thinking.json()["choices"][0]["message"]
    # the prompt opens a <think> block the tiny model never closes: all of the reply is reasoning
    assert message["reasoning_content"] and message["content"] == "", message
    plain = _chat(url, chat_template_kwargs={"enable_thinking": False}).json()["choices"][0]["message"]
    assert "reasoning_content" not in plain and plain["content"]


# ---- 10. what the ingress tells a client ----------------------------------------------------

def test_no_replica_id_in_the_answers_and_metrics_behind_the_key(cluster):
    url, handle = cluster
    replica = handle.state.remote().result()["replica"]
    answer = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 2}, headers=AUTH, timeout=60)
    assert answer.status_code == 200 and REPLICA_HEADER not in answer.headers
    assert replica not in str(answer.headers) and replica not in answer.text
    with httpx.stream("POST", f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 2, "stream": True},
                      headers=AUTH, timeout=60) as r:
        assert r.status_code == 200 and REPLICA_HEADER not in r.headers
        r.read()
    assert httpx.get(f"{url}/metrics").status_code == 401
    assert httpx.get(f"{url}/metrics", headers=AUTH).status_code == 200
    assert httpx.get(f"{url}/ready").json()["status"] == "ready"       # the probes stay public
