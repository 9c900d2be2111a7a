"""The vLLM request surface over HTTP: unknown fields ignored and named (or refused under
--strict-api), and the extra fields vLLM clients send, each shown to change the answer."""

from __future__ import annotations

import json

import httpx
import pytest
from serving_flags import TINY_FLAGS

MODEL = "tiny-llama-none"
OK_PROMPT = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "temperature": 0}
OK_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
HEADER = "x-kiln-ignored-fields"


def _post(server, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60, **kw)


@pytest.fixture(scope="module")
def strict_server(start_module_server, tiny_llama_artifact):
    return start_module_server(tiny_llama_artifact, *TINY_FLAGS, "--strict-api")


# ---- the unknown-field policy ----

def test_unknown_fields_are_ignored_and_named_in_a_header(tiny_server):
    plain = _post(tiny_server, "/v1/completions", OK_PROMPT)
    assert plain.status_code == 200 and HEADER not in plain.headers
    r = _post(tiny_server, "/v1/completions", {**OK_PROMPT, "max_token": 3, "vendor_knob": {"a": 1},
                                              "stream_options": {"include_usage": True, "extra": 1}})
    assert r.status_code == 200, r.text
    assert sorted(r.headers[HEADER].split(",")) == ["max_token", "stream_options.extra", "vendor_knob"]
    assert r.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]   # the rest applied
    with httpx.stream("POST", f"{tiny_server.url}/v1/chat/completions", timeout=60,
                      json={**OK_CHAT, "stream": True, "mystery": True}) as s:
        assert s.status_code == 200 and s.headers[HEADER] == "mystery"
        assert [line for line in s.iter_lines() if line][-1] == "data: [DONE]"
    assert "WARNING kiln.serving: ignored unknown request fields: mystery" in tiny_server.log()


def test_a_bad_known_field_is_still_400_beside_an_unknown_one(tiny_server):
    r = _post(tiny_server, "/v1/completions", {**OK_PROMPT, "mystery": 1, "top_p": 7})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_p"


@pytest.mark.parametrize("field", ["functions", "suffix", "audio"])
def test_fields_that_change_the_answer_are_refused_in_every_mode(tiny_server, field):
    r = _post(tiny_server, "/v1/chat/completions", {**OK_CHAT, field: "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == field


@pytest.mark.parametrize("body, param", [
    ({**OK_PROMPT, "max_token": 3}, "max_token"),
    ({**OK_PROMPT, "stream_options": {"include_usage": True, "extra": 1}}, "stream_options.extra"),
])
def test_strict_api_refuses_unknown_fields_by_name(strict_server, body, param):
    err = _post(strict_server, "/v1/completions", body).json()["error"]
    assert (err["param"], err["code"]) == (param, "unsupported_parameter")
    assert _post(strict_server, "/v1/completions", OK_PROMPT).status_code == 200
