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
    ("/v1/completions", {**OK_PROMPT, "prompt": ["a", "b"]}, "prompt"),
    ("/v1/completions", {**OK_PROMPT, "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {**OK_PROMPT, "max_tokens": -3}, "max_tokens"),
    ("/v1/completions", {**OK_PROMPT, "max_tokens": 5000}, "max_tokens"),          # beyond the context
    ("/v1/chat/completions", {**OK_CHAT, "max_completion_tokens": 5000}, "max_tokens"),
    ("/v1/completions", {**OK_PROMPT, "temperature": -0.5}, "temperature"),
    ("/v1/completions", {**OK_PROMPT, "temperature": "hot"}, "temperature"),
    ("/v1/completions", {**OK_PROMPT, "top_p": 0}, "top_p"),
    ("/v1/completions", {**OK_PROMPT, "top_p": 1.5}, "top_p"),
    ("/v1/completions", {**OK_PROMPT, "n": 2}, "n"),
    ("/v1/completions", {**OK_PROMPT, "logprobs": 21}, "logprobs"),
    ("/v1/chat/completions", {**OK_CHAT, "logprobs": True, "top_logprobs": 50}, "logprobs"),
    ("/v1/completions", {**OK_PROMPT, "stop": [f"s{i}" for i in range(17)]}, "stop"),
    ("/v1/completions", {**OK_PROMPT, "stop": ["z" * 300]}, "stop"),
    ("/v1/completions", {**OK_PROMPT, "presence_penalty": 3}, "presence_penalty"),
    ("/v1/completions", {**OK_PROMPT, "echo": True}, "echo"),
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
    for body in ({**OK_PROMPT, "top_p": 9}, {**OK_PROMPT, "prompt": "x" * 2000}, b"{", {**OK_PROMPT, "n": 4}):
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
