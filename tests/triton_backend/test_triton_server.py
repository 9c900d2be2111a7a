"""A real tritonserver serving the tiny model: streaming, batching, cancellation, errors, metrics."""

from __future__ import annotations

import json
import shutil
import time
import urllib.error
import urllib.request

import pytest

from kiln import LLM, RuntimeConfig, SamplingParams
from kiln.contract.manifest import MANIFEST
from kiln.serving import engine_metrics as em
from kiln.serving.triton.launch import Ports
from kiln.serving.triton.repo import RepoOptions, render_repository

from triton_client import MODEL, QUEUE_OF_ONE, infer_inputs, scrape, text_of, token_ids_of, wait_for
from triton_server import TritonServer, TritonServerError
from token_agreement import TOP_K, assert_all_close

GREEDY = dict(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_llama_artifact):
    """LLM.generate with top-k logprobs: a lone request's reply equals it, a batched one agrees up to
    the first near-tie, which the reference's own top-k judges (tests/token_agreement.py)."""
    llm = LLM(tiny_llama_artifact, RuntimeConfig(kv_cache_memory=16 << 20, threads=1))
    return lambda prompts: llm.generate(prompts, SamplingParams(**GREEDY, logprobs=TOP_K))


def test_streamed_greedy_equals_generate(open_stream, tiny_server, reference):
    stream = open_stream(tiny_server)
    stream.send("a", "The capital of France is", stream=True, **GREEDY)
    responses = stream.collect(1)["a"]
    stream.close()
    expected = reference(["The capital of France is"])[0]
    assert len(responses) > 1                                   # streamed, one response per step
    # exact: a lone request, the module's first of its prefix, one thread, as the reference runs it
    assert token_ids_of(responses) == expected.token_ids
    assert text_of(responses) == expected.text
    assert responses[-1].as_numpy("finish_reason")[0] == b"length"


def test_not_streamed_is_one_response_with_the_whole_text(tiny_server, reference):
    """Through HTTP `generate` too, which accepts exactly one response."""
    body = json.dumps({"text_input": "Hello there", **GREEDY}).encode()
    request = urllib.request.Request(f"http://{tiny_server.http_url}/v2/models/{MODEL}/generate", body)
    with urllib.request.urlopen(request, timeout=30) as r:
        reply = json.loads(r.read())
    expected = reference(["Hello there"])[0]
    assert reply["text_output"] == expected.text               # exact: a lone 11-token request (no cached block)
    assert reply["token_ids"] == expected.token_ids and reply["finish_reason"] == "length"


def test_concurrent_streams_share_one_batch(open_stream, tiny_server, reference):
    prompts = [f"Request number {i} says" for i in range(4)]
    before = scrape(tiny_server)
    stream = open_stream(tiny_server)
    for i, prompt in enumerate(prompts):
        stream.send(str(i), prompt, stream=True, **{**GREEDY, "max_tokens": 200})   # long: overlap
    responses = stream.collect(len(prompts))
    stream.close()
    batch_sizes = [int(r.as_numpy("batch_size")[0]) for rs in responses.values() for r in rs]
    assert max(batch_sizes) > 1
    expected = reference(prompts)           # the same tokens, up to a near-tie: batching does not change outputs
    assert_all_close([token_ids_of(responses[str(i)])[:24] for i in range(4)], expected, names=("served", "generated"))
    after = wait_for(lambda: (m := scrape(tiny_server))["kiln_kv_blocks_used"] == 0 and m)
    steps = after["kiln_steps_total"] - before.get("kiln_steps_total", 0)
    sequences = after["kiln_scheduled_sequences_total"] - before.get("kiln_scheduled_sequences_total", 0)
    assert sequences / steps > 1                                # mean batch size above one
    # The engine's metrics carry the names `kiln serve` uses over HTTP (tests/serving checks those).
    names = [m.name for m in (*em.GAUGES, *em.COUNTERS, em.FINISHED)] + [f"{em.BATCH_SIZE.name}_count"]
    assert not [name for name in names if name not in after]
    assert after[f"{em.BATCH_SIZE.name}_count"] - before.get(f"{em.BATCH_SIZE.name}_count", 0) == steps


def test_cancelled_stream_frees_its_blocks(open_stream, tiny_server):
    aborts_before = scrape(tiny_server).get("kiln_requests_finished_total:abort", 0)
    stream = open_stream(tiny_server)
    stream.send("long", "x" * 40, stream=True, max_tokens=900, temperature=0.0, ignore_eos=True)
    for _ in range(3):
        _, result, error = stream.next()
        assert error is None and result.as_numpy("finish_reason")[0] == b""
    assert wait_for(lambda: scrape(tiny_server)["kiln_kv_blocks_used"] > 0)
    stream.close(cancel=True)
    # Aborted (not run to its 900 tokens), and every block back in the pool.
    # NOTE: one snapshot is several metric updates; a scrape may fall between them, so poll for all.
    wait_for(lambda: (m := scrape(tiny_server)).get("kiln_requests_finished_total:abort", 0) > aborts_before
             and m["kiln_kv_blocks_used"] == 0 and m["kiln_requests_running"] == 0, timeout=20)


@pytest.mark.parametrize("prompt, knobs, message", [
    (None, dict(max_tokens=4), "text_input"),                       # Triton refuses: required input
    ("hi", dict(temperature=-1.0), "temperature must be >= 0"),     # kiln refuses: bad parameter
    ("x" * 2000, dict(max_tokens=4), "max_model_len"),              # kiln refuses: prompt too long
])
def test_bad_request_is_an_error_and_the_server_keeps_serving(open_stream, tiny_server, prompt, knobs,
                                                              message):
    stream = open_stream(tiny_server)
    if prompt is None:
        inputs = [i for i in infer_inputs("unused", **knobs) if i.name() != "text_input"]
        stream.client.async_stream_infer(MODEL, inputs, request_id="bad")
    else:
        stream.send("bad", prompt, **knobs)
    _, result, error = stream.next()
    assert result is None and message in str(error)
    stream.send("good", "still there?", max_tokens=3, temperature=0.0, ignore_eos=True)
    good = stream.collect(1)["good"]
    stream.close()
    assert len(token_ids_of(good)) == 3


def test_http_errors_are_json(tiny_server):
    body = json.dumps({"text_input": "hi", "top_p": 0}).encode()
    request = urllib.request.Request(f"http://{tiny_server.http_url}/v2/models/{MODEL}/generate", body)
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert "top_p must be in" in refused.value.read().decode()


def test_full_queue_refuses_and_the_rest_complete(open_stream, tiny_server):
    """One running sequence and one waiting request at most: of three sent at once, at least one is
    refused with UNAVAILABLE and every accepted one completes. (Long generations, so the first
    is still running when the third arrives, even on a busy machine.)"""
    stream = open_stream(tiny_server)
    for i in range(3):
        stream.send(str(i), "queue " * 8, model=QUEUE_OF_ONE, max_tokens=400, temperature=0.0, ignore_eos=True)
    finished, refused = 0, []
    while finished + len(refused) < 3:
        _, result, error = stream.next()
        if error is not None:
            refused.append(str(error))
        else:
            finished += result.as_numpy("finish_reason")[0] != b""
    stream.close()
    assert refused and all("queue is full" in e for e in refused)
    assert finished >= 1


def test_generate_stream_sse_with_stop_strings(tiny_server, tiny_llama_artifact):
    full = LLM(tiny_llama_artifact, RuntimeConfig(kv_cache_memory=16 << 20, threads=1))
    text = full.generate(["Stop me"], SamplingParams(**GREEDY))[0].text
    stop = text[6:8]
    expected = full.generate(["Stop me"], SamplingParams(**GREEDY, stop=[stop]))[0]
    assert expected.finish_reason == "stop"

    body = json.dumps({"text_input": "Stop me", "stop": [stop], "stream": True, **GREEDY}).encode()
    request = urllib.request.Request(f"http://{tiny_server.http_url}/v2/models/{MODEL}/generate_stream", body)
    with urllib.request.urlopen(request, timeout=30) as r:
        events = [json.loads(line[len(b"data: "):]) for line in r.read().splitlines() if line.startswith(b"data: ")]
    assert len(events) > 1
    assert "".join(e["text_output"] for e in events) == expected.text   # exact: a lone 7-token request, one thread
    assert events[-1]["finish_reason"] == "stop"


def test_artifact_changed_since_rendering_fails_fast(triton_install, tiny_llama_artifact, tmp_path):
    """The repository serves the manifest it was rendered from; the server exits, and the start-up
    wait reports the backend's message instead of waiting out its deadline."""
    artifact = tmp_path / "artifact"
    shutil.copytree(tiny_llama_artifact, artifact)
    render_repository(artifact, tmp_path / "repo", RepoOptions(name=MODEL))
    manifest = artifact / MANIFEST
    manifest.write_text(json.dumps(json.loads(manifest.read_text()), indent=2))   # same content, new bytes
    server = TritonServer(tmp_path / "repo", Ports.free(), tmp_path / "log", backends=tmp_path / "b",
                          start_timeout=60)
    started = time.monotonic()
    with pytest.raises(TritonServerError, match="changed since this repository was rendered"):
        server.start()
    assert time.monotonic() - started < 30 and server.process.poll() is not None
