"""kiln serve killed with SIGKILL mid-stream, then started again on the same artifact: the client
sees the connection end (no hang, no half-formed success), the artifact still verifies, and the
new server answers the same greedy request with the same text."""

from __future__ import annotations

import json
import signal
import threading

import httpx
import pytest
from serving_flags import TINY_FLAGS

from kiln.contract.artifact import EngineArtifact

BODY = {"model": "tiny", "prompt": "once upon a time", "max_tokens": 1000, "temperature": 0,
        "ignore_eos": True}


def _text(server) -> str:
    reply = httpx.post(f"{server.url}/v1/completions", json={**BODY, "max_tokens": 16}, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


def test_sigkill_mid_stream_then_restart(start_server, tiny_llama_artifact):
    flags = (*TINY_FLAGS, "--served-model-name", "tiny", "--no-response-cache")
    server = start_server(tiny_llama_artifact, *flags)
    before = _text(server)
    chunks, ended = [], {}
    first_chunk = threading.Event()

    def stream():
        try:
            with httpx.stream("POST", f"{server.url}/v1/completions", json={**BODY, "stream": True},
                              timeout=httpx.Timeout(30.0)) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        chunks.append(json.loads(line[6:]))
                        first_chunk.set()
            ended["how"] = "finished"
        except httpx.HTTPError as e:                 # the connection went away under the stream
            ended["how"] = type(e).__name__
        first_chunk.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert first_chunk.wait(30)
    server.proc.send_signal(signal.SIGKILL)
    reader.join(30)
    assert not reader.is_alive(), "the client hung after the server died"
    assert ended["how"] != "finished", "a killed server's stream cannot end as a clean success"
    assert chunks and all(c["choices"][0]["finish_reason"] is None for c in chunks)
    assert server.proc.wait(10) == -signal.SIGKILL

    EngineArtifact.load(tiny_llama_artifact, verify=True)   # every checksum still holds
    again = start_server(tiny_llama_artifact, *flags)
    assert _text(again) == before
