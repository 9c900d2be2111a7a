"""Any JSON value in any field the endpoints know: never a 5xx, and the server keeps answering. Hypothesis draws the values (NaN, huge integers, lone surrogates, nested junk)."""

from __future__ import annotations

import json

import httpx
from hypothesis import HealthCheck, given, settings, strategies as st

MODEL = "tiny-llama-none"
OK = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
OK_COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
FIELDS = ["temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
          "seed", "stop", "n", "stream", "logprobs", "top_logprobs", "logit_bias", "response_format", "tools",
          "tool_choice", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "messages", "user",
          "parallel_tool_calls", "stream_options", "ignore_eos", "model", "unknown_field", "prompt", "echo"]

scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2 ** 70), 2 ** 70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
                    st.sampled_from(["\ud800", "a\udfffb", "[a-", "text", "json_object", "function", "auto"]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=12)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chat=st.booleans(), field=st.sampled_from(FIELDS), value=values)
def test_no_value_in_any_field_is_a_server_error(tiny_server, chat, field, value):
    body = json.dumps({**(OK if chat else OK_COMPLETION), field: value}, allow_nan=True)  # NaN literals, \ud800
    path = "/v1/chat/completions" if chat else "/v1/completions"
    r = httpx.post(f"{tiny_server.url}{path}", content=body, timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code < 500, (field, value, r.text)
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_the_server_still_answers_after_the_fuzzing(tiny_server):
    r = httpx.post(f"{tiny_server.url}/v1/chat/completions", json=OK, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
