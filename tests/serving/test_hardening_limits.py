"""Connection and time limits, on by default: ServeConfig's defaults and the `kiln serve` flags
that override them, and a real `kiln serve` on loopback cutting off a body sent a byte at a time
(408), answering 503 past its concurrency limit, and closing idle keep-alive connections."""

from __future__ import annotations

import socket
import time

import httpx
import pytest
from click.testing import CliRunner

from kiln import cli
from kiln.config import ResponseCacheConfig, SemanticCacheConfig, ServeConfig
from serving_flags import TINY_FLAGS

BODY_TIMEOUT = 1.5
LIMIT = 4


def test_the_limits_are_on_by_default():
    c = ServeConfig()
    assert c.request_timeout == 600 and c.admission.max_waiting == 256
    assert c.limit_concurrency == 512 and c.keep_alive_timeout == 5
    assert c.body_timeout == 30 and c.step_timeout == 60 and c.max_body_bytes == 4 << 20


def _serve_config(monkeypatch, *flags: str) -> ServeConfig:
    """The ServeConfig `kiln serve ARTIFACT *flags` would run with (the server is not started)."""
    seen = {}
    monkeypatch.setattr("kiln.serving.http.server.run_server", lambda artifact, runtime, cfg, announce, **_: seen.update(cfg=cfg))
    result = CliRunner(env={"KILN_API_KEY": None}).invoke(cli.main, ["serve", "artifact", *flags])
    assert result.exit_code == 0, result.output
    return seen["cfg"]


def test_serve_keeps_the_defaults_and_takes_overrides(monkeypatch):
    assert _serve_config(monkeypatch) == ServeConfig()
    c = _serve_config(monkeypatch, "--request-timeout", "30", "--max-waiting", "8", "--limit-concurrency", "64",
                      "--keep-alive-timeout", "2", "--body-timeout", "4", "--max-body-size", "1MiB",
                      "--step-timeout", "120")
    assert (c.request_timeout, c.admission.max_waiting, c.limit_concurrency) == (30, 8, 64)
    assert (c.keep_alive_timeout, c.body_timeout, c.max_body_bytes, c.step_timeout) == (2, 4, 1 << 20, 120)
    off = _serve_config(monkeypatch, "--request-timeout", "0", "--max-waiting", "0", "--limit-concurrency", "0",
                        "--body-timeout", "0", "--step-timeout", "0")
    assert (off.request_timeout, off.admission.max_waiting, off.limit_concurrency, off.body_timeout, off.step_timeout) == \
        (None,) * 5


def test_serve_refuses_a_negative_limit(monkeypatch):
    monkeypatch.setattr("kiln.serving.http.server.run_server", lambda *a, **k: None)
    result = CliRunner(env={"KILN_API_KEY": None}).invoke(cli.main, ["serve", "artifact", "--body-timeout", "-1"])
    assert result.exit_code == 1 and "body_timeout" in result.output


def test_the_cache_flags_fill_the_nested_cache_configs(monkeypatch, tmp_path):
    c = _serve_config(monkeypatch, "--no-response-cache", "--semantic-cache", "--semantic-cache-model", str(tmp_path),
                      "--semantic-cache-threshold", "0.8")
    assert c.response_cache == ResponseCacheConfig(enabled=False)
    assert c.semantic_cache == SemanticCacheConfig(enabled=True, model=tmp_path, threshold=0.8)
    result = CliRunner(env={"KILN_API_KEY": None}).invoke(
        cli.main, ["serve", "artifact", "--semantic-cache-threshold", "1.5"])
    assert result.exit_code == 1 and "threshold" in result.output


@pytest.mark.parametrize("make, field", [
    (lambda: ResponseCacheConfig(max_entries=0), "max_entries"),
    (lambda: ResponseCacheConfig(ttl=0), "ttl"),
    (lambda: SemanticCacheConfig(max_bytes=0), "max_bytes"),
    (lambda: SemanticCacheConfig(threshold=-2), "threshold"),
])
def test_the_cache_configs_refuse_what_cannot_work(make, field):
    with pytest.raises(ValueError, match=field):
        make()


@pytest.fixture(scope="module")
def server(start_module_server, tiny_llama_artifact):
    return start_module_server(tiny_llama_artifact, *TINY_FLAGS, "--body-timeout", str(BODY_TIMEOUT),
                               "--limit-concurrency", str(LIMIT), "--keep-alive-timeout", "1")


def _connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=5)


def test_a_body_sent_a_byte_a_second_is_cut_off_with_408(server):
    s = _connect(server)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: 200\r\n\r\n{")
    s.settimeout(0.5)
    t0, answer = time.monotonic(), b""
    while time.monotonic() - t0 < 15:
        if not answer:
            try:
                s.sendall(b" ")                  # one byte every half second, never the whole body
            except OSError:                      # the server has closed the connection
                break
        try:
            chunk = s.recv(4096)
        except socket.timeout:
            continue
        except ConnectionResetError:             # closed while a byte was on its way
            break
        if not chunk:
            break
        answer += chunk
    seconds = time.monotonic() - t0
    s.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"request_timeout" in answer
    assert BODY_TIMEOUT - 0.5 < seconds < BODY_TIMEOUT + 5, f"cut off after {seconds:.1f} s"


def test_past_the_concurrency_limit_the_server_answers_503(server):
    idle = [_connect(server)]
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200     # 2 connections < 4
    idle += [_connect(server) for _ in range(LIMIT)]
    deadline = time.monotonic() + 15
    while httpx.get(f"{server.url}/health", timeout=10).status_code != 503:   # until they are accepted
        assert time.monotonic() < deadline, "never 503"
        time.sleep(0.05)
    for s in idle:
        s.close()
    deadline = time.monotonic() + 15
    while httpx.get(f"{server.url}/health", timeout=10).status_code != 200:   # served again
        assert time.monotonic() < deadline, "still 503"
        time.sleep(0.05)


def test_an_idle_keep_alive_connection_is_closed(server):
    s = _connect(server)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    s.settimeout(10)
    t0, answer = time.monotonic(), b""
    while True:
        chunk = s.recv(4096)
        if not chunk:                            # closed by the server
            break
        answer += chunk
    seconds = time.monotonic() - t0
    s.close()
    assert answer.startswith(b"HTTP/1.1 200")
    assert seconds < 5, f"closed after {seconds:.1f} s"
