"""The console in headless Chromium against `kiln serve` on the tiny model: chat, the dashboard
under a burst, Stop freeing a reply's blocks, and the API-key gate."""

from __future__ import annotations

import re
import threading

import httpx
import openai
import pytest
from selenium.webdriver.common.keys import Keys

from console_page import ConsolePage, wait_for
from serving_flags import TINY_FLAGS

MODEL = "tiny-llama-none"


def test_chat_streams_a_reply(tiny_server, browser):
    page = ConsolePage(browser, tiny_server.url)
    wait_for(lambda: page.by_id("send").is_enabled(), "the page to connect")
    for field, value in (("temperature", 0), ("max-tokens", 200), ("repetition-penalty", 1.3)):
        page.set_field(field, value)
    page.set_checked("ignore-eos", True)
    page.watch_replies()
    page.send("Hello there")
    reply = page.finished_reply()
    assert reply.get_attribute("data-finish") == "length"
    text = reply.find_element("css selector", ".text").get_attribute("textContent")
    # The same conversation through the official client: the page used the chat template and
    # sampling controls as sent (greedy, so both produce the same tokens). Exact: with the same prompt
    # and params the client's request is the page's cache key, answered from the response cache.
    client = openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="none", max_retries=0)
    expected = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello there"}],
                                              temperature=0, max_tokens=200,
                                              extra_body={"ignore_eos": True, "repetition_penalty": 1.3})
    meta = reply.find_element("css selector", ".meta").text
    assert text and text == expected.choices[0].message.content, meta
    assert page.text_updates() > 10, "the reply appeared whole, not streamed"
    assert f"{expected.usage.prompt_tokens} prompt + 200 completion tokens" in meta
    assert re.search(r"TTFT [\d.]+ m?s", meta) and re.search(r"[\d.]+ tok/s", meta), meta


def test_a_refused_request_shows_the_servers_reason(tiny_server, browser):
    page = ConsolePage(browser, tiny_server.url)
    wait_for(lambda: page.by_id("send").is_enabled(), "the page to connect")
    page.set_field("max-tokens", 5000)                # beyond the tiny model's 1,024-token context
    page.send("Hello")
    reply = page.finished_reply()
    assert reply.get_attribute("data-finish") == "error"
    assert "max_tokens" in reply.find_element("css selector", ".meta").text
    page.set_field("max-tokens", 4)                   # the page still works, and the refused turn is gone
    page.send("Hello again")
    assert page.finished_reply().get_attribute("data-finish") in ("stop", "length")
    sent = browser.execute_script("return chat.messages.map(m => [m.role, m.content]);")
    assert [role for role, _ in sent] == ["user", "assistant"] and sent[0][1] == "Hello again"


class Burst:
    """Long completions from `clients` threads, each sending the next as soon as one ends, until stop()."""

    def __init__(self, url: str, clients: int = 12):
        self.url, self.done = url, threading.Event()
        self.statuses: list[int] = []
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]
        for t in self.threads:
            t.start()

    def _client(self, i: int) -> None:
        body = {"model": MODEL, "prompt": f"burst {i} " * 8, "max_tokens": 900, "ignore_eos": True, "temperature": 0.9}
        with httpx.Client(timeout=120) as http:
            while not self.done.is_set():
                status = http.post(f"{self.url}/v1/completions", json=body).status_code
                self.statuses.append(status)
                if status not in (200, 429):
                    return            # a broken request would fail the same way again

    def stop(self) -> None:
        self.done.set()
        for t in self.threads:
            t.join(timeout=120)


def test_burst_moves_the_running_chart_and_kv_gauge(tiny_server, browser):
    page = ConsolePage(browser, f"{tiny_server.url}")
    page.tab("dashboard")
    # The history's newest point may predate the end of an earlier test's request by a period.
    wait_for(lambda: page.has_series("requests") and page.by_id("kv-gauge").get_attribute("data-used") == "0",
             "the dashboard at rest")
    burst = Burst(tiny_server.url)
    try:
        wait_for(lambda: page.series_max("requests", "running") > 0, "the running-requests chart to rise")
        wait_for(lambda: int(page.by_id("kv-gauge").get_attribute("data-used")) > 0, "the KV gauge to rise")
        assert int(page.value("tile-running")) > 0 or page.series_max("requests", "running") > 0
        wait_for(lambda: page.series_max("tps", "tokens/s") > 0, "the tokens/s chart to rise")
    finally:
        burst.stop()
    assert 200 in burst.statuses
    # The burst is over: the gauge falls back to zero and the finished requests' latencies show.
    wait_for(lambda: page.by_id("kv-gauge").get_attribute("data-used") == "0", "the KV gauge to fall to 0")
    wait_for(lambda: page.value("tile-running") == "0", "no running requests")
    wait_for(lambda: page.series_max("ttft", "p50") > 0 and page.series_max("itl", "p99") > 0,
             "TTFT and ITL percentiles")
    assert page.series_max("batch", "mean") > 1       # several streams shared each step


def test_stop_cancels_the_reply_and_frees_its_blocks(tiny_server, browser):
    page = ConsolePage(browser, tiny_server.url)
    wait_for(lambda: page.by_id("send").is_enabled(), "the page to connect")
    page.set_field("max-tokens", 900)
    page.set_checked("ignore-eos", True)
    before = tiny_server.metrics()
    aborted = 'kiln_requests_finished_total{finish_reason="abort"}'
    page.stop_at_first_token()
    page.send("Tell me a long story")
    reply = page.finished_reply()
    assert reply.get_attribute("data-finish") == "stopped"
    meta = reply.find_element("css selector", ".meta").text
    assert "stopped by you" in meta
    received = int(re.search(r"~(\d+) tokens received", meta).group(1))
    assert 1 <= received < 900
    # The server aborted the request (it did not run to its length) and freed its blocks ...
    wait_for(lambda: tiny_server.metrics().get(aborted, 0) == before.get(aborted, 0) + 1, "the engine's abort")
    assert tiny_server.metrics()["kiln_kv_blocks_used"] == 0
    # ... and the page's own KV counter shows them free.
    wait_for(lambda: page.value("live-kv") == "0", "the page's KV counter at 0")
    assert not page.by_id("send").get_attribute("hidden") and page.by_id("send").is_enabled()


@pytest.fixture(scope="module")
def keyed_server(start_module_server, tiny_llama_artifact):
    return start_module_server(tiny_llama_artifact, *TINY_FLAGS, "--api-key", "sesame")


def test_api_key_gate(keyed_server, browser):
    # The page itself is open to all and holds no key; what it reads needs one, like /v1/*.
    assert "sesame" not in httpx.get(f"{keyed_server.url}/").text
    for path in ("/console/api/card", "/console/api/stats", "/console/api/stats/stream"):
        assert httpx.get(f"{keyed_server.url}{path}").status_code == 401, path
    assert httpx.get(f"{keyed_server.url}/console/api/card", headers={"Authorization": "Bearer sesame"}).is_success
    page = ConsolePage(browser, keyed_server.url)
    wait_for(lambda: page.by_id("key-gate").is_displayed(), "the API-key prompt")
    assert not page.by_id("send").is_enabled()
    # Enter in the message box sends nothing while the page is locked.
    page.by_id("prompt").send_keys("hello?", Keys.ENTER)
    assert page.replies() == [] and keyed_server.metrics().get("kiln_generation_tokens_total", 0) == 0
    # A wrong key is refused and the page stays locked.
    page.set_field("api-key", "nope")
    page.by_id("key-submit").click()
    wait_for(lambda: "refused" in page.by_id("key-error").text, "the refusal")
    assert page.by_id("key-gate").is_displayed() and not page.by_id("send").is_enabled()
    # The right key unlocks chat and the dashboard's stream.
    page.set_field("api-key", "sesame")
    page.by_id("key-submit").click()
    wait_for(lambda: not page.by_id("key-gate").is_displayed(), "the gate to open")
    page.set_field("max-tokens", 8)
    page.send("hello!")
    assert page.finished_reply().get_attribute("data-finish") in ("stop", "length")
    wait_for(lambda: "on" in page.by_id("live-dot").get_attribute("class"), "the live stats stream")
