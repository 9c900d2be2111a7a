"""The vLLM request surface over HTTP: unknown fields ignored and named (or refused under
--strict-api), and the extra fields vLLM clients send, each shown to change the answer."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from serving_flags import TINY_FLAGS

MODEL = "tiny-llama-none"
OK_PROMPT = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "temperature": 0}
OK_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
HEADER = "x-kiln-ignored-fields"


def _post(server, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60, **kw)


# A template of kiln's own: a variable only chat_template_kwargs sets, transformers' tojson (key
# order kept, no HTML escaping) and a loop control.
TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}"
            "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if greeting is defined %}{{ greeting | tojson }}{% endif %}<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def strict_server(start_module_server, tiny_llama_artifact, tmp_path_factory):
    """--strict-api, priority scheduling and a --chat-template override, on one server."""
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    return start_module_server(tiny_llama_artifact, *TINY_FLAGS, "--strict-api", "--scheduling-policy", "priority",
                               "--chat-template", str(template))


@pytest.fixture(scope="module")
def tok(tiny_llama_artifact):
    from kiln.contract.artifact import EngineArtifact
    from kiln.tokenizer import Tokenizer
    return Tokenizer(EngineArtifact.load(tiny_llama_artifact).tokenizer_dir)


def _completion(server, **extra) -> dict:
    r = _post(server, "/v1/completions", {**OK_PROMPT, "max_tokens": 6, **extra})
    assert r.status_code == 200, r.text
    return r.json()


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


def test_an_unknown_field_of_any_name_is_named_safely(tiny_server):
    """A name is any JSON string: control characters and commas are escaped in the header (a raw
    one made h11 drop the connection: the fuzz test found it)."""
    r = _post(tiny_server, "/v1/completions", {**OK_PROMPT, "stream_options": {"\x1f": None, "a\nb,c": 1}})
    assert r.status_code == 200, r.text
    assert sorted(r.headers[HEADER].split(",")) == ["stream_options.\\u001f", "stream_options.a\\u000ab\\u002cc"]


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


# ---- vLLM's sampling extensions, each shown to change the answer ----

def test_stop_token_ids_end_the_output_on_that_token(tiny_server, tok):
    a = tok.encode("a")[-1]
    forced = {"logit_bias": {str(a): 100}, "ignore_eos": True}
    assert _completion(tiny_server, **forced)["choices"][0]["text"] == "a" * 6
    out = _completion(tiny_server, **forced, stop_token_ids=[a])
    assert (out["choices"][0]["text"], out["choices"][0]["finish_reason"]) == ("a", "stop")
    assert out["usage"]["completion_tokens"] == 1
    r = _post(tiny_server, "/v1/completions", {**OK_PROMPT, "stop_token_ids": [10 ** 6]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids"


def test_min_tokens_hold_eos_back_and_skip_special_tokens_shows_it(tiny_server, tok):
    eos = tok.eos_token_id
    forced = {"logit_bias": {str(eos): 100}, "max_tokens": 8}
    assert _completion(tiny_server, **forced)["usage"]["completion_tokens"] == 1
    held = _completion(tiny_server, **forced, min_tokens=5)
    assert held["usage"]["completion_tokens"] == 6 and held["choices"][0]["finish_reason"] == "stop"
    shown = _completion(tiny_server, **forced, skip_special_tokens=False)
    assert shown["choices"][0]["text"] == "<|im_end|>"
    assert _completion(tiny_server, **forced)["choices"][0]["text"] == ""
    r = _post(tiny_server, "/v1/completions", {**OK_PROMPT, "min_tokens": 9})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"


def test_include_stop_str_in_output_keeps_the_stop_string(tiny_server, tok):
    forced = {"logit_bias": {str(tok.encode("a")[-1]): 100}, "ignore_eos": True, "stop": ["aa"]}
    assert _completion(tiny_server, **forced)["choices"][0]["text"] == ""
    kept = _completion(tiny_server, **forced, include_stop_str_in_output=True)["choices"][0]
    assert (kept["text"], kept["finish_reason"]) == ("aa", "stop")


def test_priority_needs_the_priority_policy(tiny_server, strict_server):
    refused = _post(tiny_server, "/v1/completions", {**OK_PROMPT, "priority": 3})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority"
    assert _post(tiny_server, "/v1/completions", {**OK_PROMPT, "priority": 0}).status_code == 200
    assert _post(strict_server, "/v1/completions", {**OK_PROMPT, "priority": -5}).status_code == 200


def test_chat_template_override_and_its_kwargs(strict_server):
    chat = {**OK_CHAT, "messages": [{"role": "system", "content": "dropped by `continue`"},
                                    {"role": "user", "content": "hi"}]}
    plain = _post(strict_server, "/v1/chat/completions", chat).json()["usage"]["prompt_tokens"]
    # <|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant: a token per marker and per byte (Jinja
    # drops the template's last newline, as transformers' environment does)
    assert plain == 3 + len("user\nhi\n") + len("assistant")
    greeting = {"b": "<x>", "a": 1}                          # tojson: '{"b": "<x>", "a": 1}'
    r = _post(strict_server, "/v1/chat/completions", {**chat, "chat_template_kwargs": {"greeting": greeting}})
    assert r.json()["usage"]["prompt_tokens"] == plain + len(json.dumps(greeting))
    clash = _post(strict_server, "/v1/chat/completions", {**chat, "chat_template_kwargs": {"messages": []}})
    assert clash.status_code == 400 and "messages" in clash.json()["error"]["message"]


def test_continuous_usage_stats_count_up_chunk_by_chunk(tiny_server):
    body = {**OK_PROMPT, "max_tokens": 5, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", f"{tiny_server.url}/v1/completions", json=body, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert all(e["usage"]["prompt_tokens"] == 2 for e in events)
    assert counts == sorted(counts) and counts[-1] == 5 and counts[0] >= 1


# ---- n, best_of, list prompts, echo with prompt logprobs ----

def _texts(out: dict) -> list[str]:
    assert [c["index"] for c in out["choices"]] == list(range(len(out["choices"])))
    return [c["text"] for c in out["choices"]]


def test_n_choices_are_seeded_samples_that_differ(tiny_server):
    kw = {"temperature": 1.0, "seed": 11, "ignore_eos": True, "max_tokens": 8}
    out = _completion(tiny_server, n=3, best_of=3, **kw)
    texts = _texts(out)
    assert len(set(texts)) == 3
    # choice j samples with seed + j: each is the single request with that seed
    assert [_completion(tiny_server, **{**kw, "seed": 11 + j})["choices"][0]["text"] for j in range(3)] == texts
    assert out["usage"]["prompt_tokens"] == 2 and out["usage"]["completion_tokens"] == 24
    chat = _post(tiny_server, "/v1/chat/completions", {**OK_CHAT, "n": 2, **kw}).json()
    assert [c["index"] for c in chat["choices"]] == [0, 1] and chat["usage"]["completion_tokens"] == 16


def test_n_streams_every_choice_as_the_whole_response_has_it(tiny_server):
    body = {**OK_PROMPT, "n": 2, "temperature": 1.0, "seed": 3, "ignore_eos": True, "max_tokens": 6,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{tiny_server.url}/v1/completions", json=body, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    streamed = ["", ""]
    for e in events[:-1]:
        for c in e["choices"]:
            streamed[c["index"]] += c["text"]
    assert streamed == _texts(_completion(tiny_server, **{**body, "stream": False}))
    assert events[-1]["usage"]["completion_tokens"] == 12


def test_n_siblings_compute_the_prompt_once_through_the_prefix_cache(tiny_server, tiny_llama_artifact):
    from kiln.contract.artifact import EngineArtifact
    block = EngineArtifact.load(tiny_llama_artifact).manifest.kv_layout.block_size
    prompt = [(7 * i + 13) % 250 for i in range(6 * block + 5)]      # a prompt no other test sends
    before = tiny_server.metrics()["kiln_prefix_cache_hits_total"]
    out = _completion(tiny_server, prompt=prompt, n=4, temperature=1.0, seed=1, max_tokens=3)
    assert len(out["choices"]) == 4
    # the first choice computes the prompt; each sibling finds its 6 full blocks cached
    deadline = time.monotonic() + 10
    while tiny_server.metrics()["kiln_prefix_cache_hits_total"] - before < 3 * 6 * block and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tiny_server.metrics()["kiln_prefix_cache_hits_total"] - before == 3 * 6 * block


def test_list_prompts_are_answered_in_order(tiny_server):
    out = _completion(tiny_server, prompt=["ab", "cde"], n=2, ignore_eos=True)
    alone = [_completion(tiny_server, prompt=p, ignore_eos=True)["choices"][0]["text"] for p in ("ab", "cde")]
    assert _texts(out) == [alone[0], alone[0], alone[1], alone[1]]          # greedy: siblings agree
    assert out["usage"]["prompt_tokens"] == 5 and out["usage"]["completion_tokens"] == 24
    too_many = _post(tiny_server, "/v1/completions", {**OK_PROMPT, "prompt": ["a"] * 33, "n": 2})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "prompt"


def test_echo_with_max_tokens_0_returns_the_prompts_logprobs(tiny_server, tok):
    """What lm-eval's log-likelihood requests send; each prompt token's logprob is the one the
    model gives it as the next token after the tokens before it."""
    prompt = "kiln fires"
    out = _completion(tiny_server, prompt=prompt, echo=True, max_tokens=0, logprobs=2)
    choice = out["choices"][0]
    assert choice["text"] == prompt and out["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    ids = tok.encode(prompt)
    assert lp["tokens"] == [tok.decode([t]) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(len(top) == 2 for top in lp["top_logprobs"][1:])
    for k in (1, 4, len(ids) - 1):
        # the same score, from a generation step: prompt ids[:k], the next token forced to ids[k]
        step = _completion(tiny_server, prompt=ids[:k], max_tokens=1, logprobs=0, logit_bias={str(ids[k]): 100})
        assert lp["token_logprobs"][k] == pytest.approx(step["choices"][0]["logprobs"]["token_logprobs"][0], abs=1e-3)
    more = _completion(tiny_server, prompt=prompt, echo=True, max_tokens=3, ignore_eos=True)
    assert more["choices"][0]["text"] == prompt + _completion(tiny_server, prompt=prompt, max_tokens=3,
                                                               ignore_eos=True)["choices"][0]["text"]
    assert _post(tiny_server, "/v1/completions", {**OK_PROMPT, "max_tokens": 0}).status_code == 400


# ---- /tokenize, /detokenize, /version, /openapi.json, /docs ----

def test_tokenize_counts_what_the_endpoints_count_and_detokenize_inverts_it(tiny_server, tok):
    r = _post(tiny_server, "/tokenize", {"model": MODEL, "prompt": "hello kiln"}).json()
    assert r["tokens"] == tok.encode("hello kiln") and r["count"] == len(r["tokens"]) and r["max_model_len"] == 1024
    chat = _post(tiny_server, "/v1/chat/completions", OK_CHAT).json()["usage"]["prompt_tokens"]
    assert _post(tiny_server, "/tokenize", {"messages": OK_CHAT["messages"]}).json()["count"] == chat
    bare = _post(tiny_server, "/tokenize", {"messages": OK_CHAT["messages"], "add_generation_prompt": False})
    assert bare.json()["count"] < chat
    assert _post(tiny_server, "/detokenize", {"tokens": r["tokens"]}).json() == {"prompt": "hello kiln"}
    for path, body, param in [("/detokenize", {"tokens": [10 ** 6]}, "tokens"),
                              ("/tokenize", {"prompt": "a", "messages": OK_CHAT["messages"]}, "prompt"),
                              ("/tokenize", {"prompt": 5}, "prompt")]:
        bad = _post(tiny_server, path, body)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
    assert _post(tiny_server, "/tokenize", {"prompt": "a", "model": "gpt-9"}).status_code == 404


def test_version_openapi_and_docs(tiny_server):
    from importlib.metadata import version
    assert httpx.get(f"{tiny_server.url}/version").json() == {"version": version("kiln")}
    spec = httpx.get(f"{tiny_server.url}/openapi.json").json()
    op = spec["paths"]["/v1/completions"]["post"]
    assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"] == "#/components/schemas/CompletionRequest"
    fields = spec["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"prompt", "n", "best_of", "echo", "min_tokens", "stop_token_ids", "priority"} <= set(fields)
    assert "chat_template_kwargs" in spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    page = httpx.get(f"{tiny_server.url}/docs")
    assert page.headers["content-type"].startswith("text/html")
    assert all(f"<code>{path}</code>" in page.text for path in spec["paths"])


# ---- usage: exact, and what it counts ----

def test_usage_counts_the_tokens_the_model_read_and_wrote(tiny_server, tiny_llama_artifact, tok):
    """prompt_tokens: the rendered chat template's tokens (as transformers' apply_chat_template
    counts them; a load generator counting only the message text sees fewer); completion_tokens:
    every token generated, an EOS that ended the reply included (as vLLM counts)."""
    from transformers import PreTrainedTokenizerFast
    from kiln.contract.artifact import EngineArtifact
    folder = EngineArtifact.load(tiny_llama_artifact).tokenizer_dir
    hf = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), eos_token="<|im_end|>")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count me, exactly."}]
    body = {**OK_CHAT, "messages": messages, "max_tokens": 7, "ignore_eos": True, "logprobs": True}
    whole = _post(tiny_server, "/v1/chat/completions", body).json()
    rendered = hf.apply_chat_template(messages, chat_template=tok.chat_template, add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
    assert whole["usage"]["prompt_tokens"] == len(rendered) > len(tok.encode("Be brief.Count me, exactly."))
    assert whole["usage"]["completion_tokens"] == 7 == len(whole["choices"][0]["logprobs"]["content"])
    with httpx.stream("POST", f"{tiny_server.url}/v1/chat/completions", timeout=60,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        last = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")][-1]
    assert last["usage"] == whole["usage"]
    ended = _completion(tiny_server, logit_bias={str(tok.eos_token_id): 100}, max_tokens=8)
    assert (ended["choices"][0]["text"], ended["usage"]["completion_tokens"]) == ("", 1)


def test_logprob_bytes_are_the_tokens_own_bytes(tiny_server, tok):
    """A token holding half of "é" has the byte 0xC3, not U+FFFD's three bytes (what decoding it
    alone gives), so a client that joins the bytes of the tokens rebuilds the text."""
    first, second = tok.encode("é")
    body = {**OK_CHAT, "max_tokens": 2, "logprobs": True, "top_logprobs": 1,
            "logit_bias": {str(first): 100}, "ignore_eos": True}
    content = _post(tiny_server, "/v1/chat/completions", body).json()["choices"][0]["logprobs"]["content"]
    assert content[0]["bytes"] == [0xC3] and content[0]["token"] == "\ufffd"
    # the second token (forced) completes the character: the two tokens' bytes are "é" in UTF-8
    pair = _post(tiny_server, "/v1/completions", {**OK_PROMPT, "max_tokens": 1, "logprobs": 0,
                                                   "logit_bias": {str(second): 100}}).json()
    assert pair["choices"][0]["logprobs"]["tokens"] == ["\ufffd"]
    assert bytes([0xC3] + list(tok.token_bytes(second))).decode() == "é"


# ---- tool calls in a Llama-3 template's syntax ----

@pytest.fixture(scope="module")
def llama3_server(start_module_server, tiny_llama_artifact, tmp_path_factory):
    from test_chat_template_golden import LLAMA3_STYLE  # same folder
    template = tmp_path_factory.mktemp("llama3") / "chat.jinja"
    template.write_text(LLAMA3_STYLE)
    return start_module_server(tiny_llama_artifact, *TINY_FLAGS, "--chat-template", str(template))


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}}


def test_a_llama3_template_gets_its_calls_parsed_whole_and_streamed(llama3_server):
    body = {**OK_CHAT, "max_tokens": 60, "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    out = _post(llama3_server, "/v1/chat/completions", body).json()["choices"][0]
    assert "tool_calls" in out["message"], out
    call = out["message"]["tool_calls"][0]["function"]
    assert out["finish_reason"] == "tool_calls" and call["name"] == "get_weather"
    assert json.loads(call["arguments"])["city"] in ("Paris", "Rome")
    with httpx.stream("POST", f"{llama3_server.url}/v1/chat/completions", json={**body, "stream": True},
                      timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [c["delta"] for e in events for c in e["choices"]]
    streamed = [d["tool_calls"][0]["function"] for d in deltas if "tool_calls" in d]
    assert streamed == [call] and events[-1]["choices"][0]["finish_reason"] == "tool_calls"


# ---- <think> blocks into reasoning_content ----

THINK_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                  "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
                  "<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}")


@pytest.fixture(scope="module")
def think_server(start_module_server, tiny_llama_artifact, tmp_path_factory):
    template = tmp_path_factory.mktemp("think") / "chat.jinja"
    template.write_text(THINK_TEMPLATE)
    return start_module_server(tiny_llama_artifact, *TINY_FLAGS, "--chat-template", str(template))


def test_a_think_block_becomes_reasoning_content(think_server):
    """Thinking on, the prompt opens the block and the tiny model never closes it: all of the reply
    is reasoning. Thinking off (chat_template_kwargs), the prompt closes it: all is content."""
    body = {**OK_CHAT, "max_tokens": 8, "ignore_eos": True}
    thinking = _post(think_server, "/v1/chat/completions", body).json()["choices"][0]["message"]
    plain = _post(think_server, "/v1/chat/completions",
                  {**body, "chat_template_kwargs": {"enable_thinking": False}}).json()["choices"][0]["message"]
    assert thinking["content"] == "" and thinking["reasoning_content"]
    assert "reasoning_content" not in plain and plain["content"]
    with httpx.stream("POST", f"{think_server.url}/v1/chat/completions", json={**body, "stream": True},
                      timeout=60) as r:
        deltas = [c["delta"] for line in r.iter_lines() if line.startswith("data: {")
                  for c in json.loads(line[6:])["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == thinking["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == ""
