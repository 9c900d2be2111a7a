"""Every refusal, through raw httpx: status, an OpenAI-style error body, and nothing else disturbed."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

MODEL = "tiny-llama-none"
OK_PROMPT = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
OK_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def _post(server, path: str, body) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(f"{server.url}{path}", content=content, timeout=30,
                      headers={"content-type": "application/json"})


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"model": MODEL, "max_tokens": 4}, "prompt"),
    ("/v1/chat/completions", {"model": MODEL, "max_tokens": 4}, "messages"),
    ("/v1/chat/completions", {**OK_CHAT, "messages": []}, "messages"),
    ("/v1/chat/completions", {**OK_CHAT, "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ("/v1/completions", {**OK_PROMPT, "prompt": "x" * 2000}, "prompt"),           # beyond the context
    ("/v1/chat/completions", {**OK_CHAT, "messages": [{"role": "user", "content": "y" * 2000}]}, "messages"),
    ("/v1/completions", {**OK_PROMPT, "prompt": [1, 2, 10 ** 9]}, "prompt"),       # not a token id
    ("/v1/completions", {**OK_PROMPT, "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {**OK_PROMPT, "max_tokens": -3}, "max_tokens"),
    ("/v1/completions", {**OK_PROMPT, "max_tokens": 5000}, "max_tokens"),          # beyond the context
    ("/v1/chat/completions", {**OK_CHAT, "max_completion_tokens": 5000}, "max_tokens"),
    ("/v1/completions", {**OK_PROMPT, "temperature": -0.5}, "temperature"),
    ("/v1/completions", {**OK_PROMPT, "temperature": "hot"}, "temperature"),
    ("/v1/completions", {**OK_PROMPT, "top_p": 0}, "top_p"),
    ("/v1/completions", {**OK_PROMPT, "top_p": 1.5}, "top_p"),
    ("/v1/completions", {**OK_PROMPT, "n": 0}, "n"),
    ("/v1/completions", {**OK_PROMPT, "n": 2, "best_of": 3}, "best_of"),
    ("/v1/completions", {**OK_PROMPT, "logprobs": 21}, "logprobs"),
    ("/v1/chat/completions", {**OK_CHAT, "logprobs": True, "top_logprobs": 50}, "logprobs"),
    ("/v1/completions", {**OK_PROMPT, "stop": [f"s{i}" for i in range(17)]}, "stop"),
    ("/v1/completions", {**OK_PROMPT, "stop": ["z" * 300]}, "stop"),
    ("/v1/completions", {**OK_PROMPT, "presence_penalty": 3}, "presence_penalty"),
])
def test_invalid_request_is_400(tiny_server, path, body, param):
    err = _error(_post(tiny_server, path, body), 400)
    assert err["type"] == "invalid_request_error" and err["param"] == param


@pytest.mark.parametrize("raw", [b"{not json", b"", b"\xff\xfe", b"[1, 2]", b"null"])
def test_malformed_body_is_400(tiny_server, raw):
    _error(_post(tiny_server, "/v1/completions", raw), 400)


def test_unknown_model_is_404(tiny_server):
    err = _error(_post(tiny_server, "/v1/completions", {**OK_PROMPT, "model": "gpt-9"}), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model"


def test_body_over_the_limit_is_413(tiny_server):
    big = json.dumps({**OK_PROMPT, "prompt": "x" * (5 << 20)})
    _error(_post(tiny_server, "/v1/completions", big), 413)


def test_errors_do_not_disturb_requests_in_flight(tiny_server):
    """A long stream runs while every kind of bad request is refused around it."""
    result = {}

    def stream():
        body = {**OK_PROMPT, "max_tokens": 300, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{tiny_server.url}/v1/completions", json=body, timeout=60) as r:
            result["lines"] = [line for line in r.iter_lines() if line.startswith("data: ")]

    t = threading.Thread(target=stream)
    t.start()
    for body in ({**OK_PROMPT, "top_p": 9}, {**OK_PROMPT, "prompt": "x" * 2000}, b"{", {**OK_PROMPT, "n": 0}):
        assert _post(tiny_server, "/v1/completions", body).status_code == 400
    t.join(60)
    lines = result["lines"]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["usage"]["completion_tokens"] == 300
    assert json.loads(lines[-3][6:])["choices"][0]["finish_reason"] == "length"


def test_rejections_are_counted(tiny_server):
    before = tiny_server.metrics().get('kiln_requests_rejected_total{reason="invalid"}', 0)
    _post(tiny_server, "/v1/completions", b"{")
    assert tiny_server.metrics()['kiln_requests_rejected_total{reason="invalid"}'] == before + 1


# ---- issue 12 item 4: every malformed input a 4xx, and the next good request still answers ----

def _nested(depth: int) -> str:
    return '{"model": "%s", "prompt": "hi", "user": %s}' % (MODEL, "[" * depth + "]" * depth)


@pytest.mark.parametrize("path, body, param", [
    # wrong JSON types: no coercion
    ("/v1/completions", {**OK_PROMPT, "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {**OK_PROMPT, "max_tokens": 4.0}, "max_tokens"),
    ("/v1/completions", {**OK_PROMPT, "max_tokens": "4"}, "max_tokens"),
    ("/v1/completions", {**OK_PROMPT, "temperature": False}, "temperature"),
    ("/v1/completions", {**OK_PROMPT, "seed": 1.5}, "seed"),
    ("/v1/completions", {**OK_PROMPT, "stream": "yes"}, "stream"),
    ("/v1/chat/completions", {**OK_CHAT, "logprobs": 1}, "logprobs"),
    ("/v1/completions", {**OK_PROMPT, "prompt": [1, True]}, "prompt"),
    # integers outside what the sampler accepts
    ("/v1/completions", {**OK_PROMPT, "seed": -1}, "seed"),
    ("/v1/completions", {**OK_PROMPT, "seed": 2 ** 64}, "seed"),
    ("/v1/completions", {**OK_PROMPT, "top_k": -2}, "top_k"),
    ("/v1/completions", {**OK_PROMPT, "top_k": 2 ** 40}, "top_k"),
    ("/v1/completions", {**OK_PROMPT, "max_tokens": 10 ** 30}, "max_tokens"),
    ("/v1/completions", {**OK_PROMPT, "n": 10 ** 30}, "n"),
    ("/v1/chat/completions", {**OK_CHAT, "logprobs": True, "top_logprobs": -1}, "logprobs"),
    ("/v1/chat/completions", {**OK_CHAT, "top_logprobs": 2}, "top_logprobs"),
    # out-of-range floats
    ("/v1/completions", {**OK_PROMPT, "temperature": 1e6}, "temperature"),
    ("/v1/completions", {**OK_PROMPT, "repetition_penalty": 1e39}, "repetition_penalty"),
    ("/v1/completions", {**OK_PROMPT, "min_p": 1.0}, "min_p"),
    # logit_bias: OpenAI's shape, ids within the vocabulary, biases in [-100, 100]
    ("/v1/completions", {**OK_PROMPT, "logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {**OK_PROMPT, "logit_bias": {"999999": 1}}, "logit_bias"),
    ("/v1/completions", {**OK_PROMPT, "logit_bias": {"-3": 1}}, "logit_bias"),
    ("/v1/completions", {**OK_PROMPT, "logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {**OK_PROMPT, "logit_bias": {"5": 1, "05": 2}}, "logit_bias"),
    ("/v1/completions", {**OK_PROMPT, "logit_bias": {"9" * 5000: 1}}, "logit_bias"),
    ("/v1/completions", {**OK_PROMPT, "logit_bias": [5]}, "logit_bias"),
    # unknown content parts
    ("/v1/chat/completions", {**OK_CHAT, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "http://x"}}]}]},
     "messages.0.content.1.type"),
    # messages the template cannot render
    ("/v1/chat/completions", {**OK_CHAT, "messages": [{"role": "user", "content": None}]}, "messages.0.content"),
    ("/v1/chat/completions", {**OK_CHAT, "messages": [{"role": "user", "content": "a"}, {"role": "user"}]},
     "messages.1.content"),
    ("/v1/chat/completions", {**OK_CHAT, "messages": [{"role": "assistant", "content": None,
                                                       "tool_calls": [{"id": "c", "function": {}}]}]}, "messages"),
    ("/v1/chat/completions", {**OK_CHAT, "messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    # OpenAI fields that change the answer's meaning and kiln does not implement: refused by name
    # (other unknown fields are ignored and named in a header: test_api_surface.py)
    ("/v1/chat/completions", {**OK_CHAT, "functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {**OK_CHAT, "audio": {"voice": "alloy"}}, "audio"),
    ("/v1/completions", {**OK_PROMPT, "suffix": "x"}, "suffix"),
])
def test_malformed_field_is_400_and_the_server_still_answers(tiny_server, path, body, param):
    err = _error(_post(tiny_server, path, body), 400)
    assert err["param"] == param, err
    _still_answers(tiny_server)


@pytest.mark.parametrize("raw, words", [
    ('{"model": "%s", "prompt": "hi", "temperature": NaN}' % MODEL, "NaN"),
    ('{"model": "%s", "prompt": "hi", "top_p": Infinity}' % MODEL, "Infinity"),
    ('{"model": "%s", "prompt": "hi", "temperature": -Infinity}' % MODEL, "Infinity"),
    ('{"model": "%s", "prompt": "hi", "temperature": 1e999}' % MODEL, "too large"),
    ('{"model": "%s", "prompt": "a\\ud800b"}' % MODEL, "Unicode"),
    ('{"model": "%s", "messages": [{"role": "user", "content": "\\udfff"}]}' % MODEL, "Unicode"),
    ('{"model": "%s", "prompt": "hi", "stop": ["\\ud83d"]}' % MODEL, "Unicode"),
    (_nested(65), "nests deeper"),
    (_nested(100_000), "nests deeper"),          # past Python's recursion limit
])
def test_malformed_json_is_400_and_the_server_still_answers(tiny_server, raw, words):
    path = "/v1/chat/completions" if "messages" in raw else "/v1/completions"
    err = _error(_post(tiny_server, path, raw.encode()), 400)
    assert words in err["message"] and err["code"] == "invalid_json", err
    _still_answers(tiny_server)


def test_null_for_an_unknown_field_means_not_given(tiny_server):
    r = _post(tiny_server, "/v1/chat/completions", {**OK_CHAT, "functions": None, "logit_bias": None})
    assert r.status_code == 200, r.text


def test_an_oversized_body_is_413_and_the_server_still_answers(tiny_server):
    _error(_post(tiny_server, "/v1/completions", b'{"prompt": "' + b"x" * (5 << 20) + b'"}'), 413)
    _still_answers(tiny_server)


def _still_answers(server) -> None:
    r = _post(server, "/v1/completions", {**OK_PROMPT, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


# ---- logit_bias, implemented: OpenAI semantics through the real server ----

def _greedy_text(server, **extra) -> str:
    body = {**OK_PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True, **extra}
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_logit_bias_of_100_forces_a_token_and_minus_100_bans_one(tiny_server, tiny_llama_artifact):
    from kiln.contract.artifact import EngineArtifact
    from kiln.tokenizer import Tokenizer
    tok = Tokenizer(EngineArtifact.load(tiny_llama_artifact).tokenizer_dir)
    a, b = tok.encode("a")[-1], tok.encode("b")[-1]
    assert _greedy_text(tiny_server, logit_bias={str(a): 100}) == tok.decode([a] * 6)
    # Both pushed far above the rest; banning one leaves the other every time.
    assert _greedy_text(tiny_server, logit_bias={str(a): -100, str(b): 100}) == tok.decode([b] * 6)
    assert _greedy_text(tiny_server, logit_bias={str(a): 100, str(b): -100}) == tok.decode([a] * 6)
