"""Regenerate the README's console screenshots: the playground after a short chat, and the dashboard
and artifact card while a load runs.

    flock /tmp/kiln-heavy.lock nice -n 10 .venv/bin/python scripts/console_screenshots.py

It builds the SmolLM2 int4 artifact into engines/smollm2-int4 when that folder is missing (or uses
--artifact), starts `kiln serve` on a free loopback port, drives headless Chromium (Debian's
chromium + chromium-driver, as the console tests do) and writes PNGs to docs/images/.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from selenium.webdriver.common.by import By

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "console"))
from headless import Browser, missing  # noqa: E402  (a test helper: selenium and Debian chromium)

ROOT = Path(__file__).resolve().parents[1]
KILN = Path(sys.executable).parent / "kiln"
QUESTIONS = ["What is the capital of France?", "Name three uses of copper.", "Why is the sky blue?",
             "Write a haiku about autumn.", "Explain photosynthesis in two sentences.",
             "What does a compiler do?", "Give me a tip for learning to cook.", "How far is the Moon?"]
SYSTEM = "You are a concise, friendly assistant."     # a shared prefix: the prefix cache gets hits


def main() -> None:
    args = _parse()
    if (reason := missing()) is not None:
        sys.exit(f"cannot start Chromium: {reason}")
    artifact = args.artifact or _default_artifact()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([str(KILN), "serve", str(artifact), "--port", str(port),
                               "--served-model-name", "smollm2-135m-int4", "--max-waiting", str(args.max_waiting),
                               "--kv-cache-memory", args.kv_cache_memory],
                              stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    browser = None
    try:
        _wait_ready(url, server)
        browser = Browser(1280, 860)
        _playground(browser.driver, url, args.out / "console-playground.png")
        _under_load(browser.driver, url, args)
    finally:
        if browser is not None:
            browser.close()
        server.terminate()
        server.wait(timeout=30)


def _parse():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--artifact", type=Path, help="an artifact folder (default: engines/smollm2-int4, built if missing)")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "images")
    p.add_argument("--load-seconds", type=float, default=75.0, help="how long the load runs before the dashboard shot")
    p.add_argument("--concurrency", type=int, default=10, help="clients sending requests back to back")
    p.add_argument("--max-waiting", type=int, default=6, help="kiln serve --max-waiting, so the load meets some 429s")
    p.add_argument("--kv-cache-memory", default="256MiB", help="a pool small enough for the KV gauge to move")
    return p.parse_args()


def _default_artifact() -> Path:
    out = ROOT / "engines" / "smollm2-int4"
    if not (out / "manifest.json").exists():
        subprocess.run([str(KILN), "build", "smollm2-135m", "--quant", "int4", "--out", str(out), "--force"], check=True)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str, server: subprocess.Popen, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            sys.exit(f"kiln serve exited with {server.returncode}")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    sys.exit(f"kiln serve was not ready within {timeout:.0f} s")


def _wait(predicate, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("the page did not get there in time")
        time.sleep(0.2)


def _playground(driver, url: str, png: Path) -> None:
    driver.get(f"{url}/#playground")
    _wait(lambda: driver.find_element(By.ID, "send").is_enabled())
    # Greedy, and the chat template's own system prompt: SmolLM2-135M at temperature 0 repeats
    # itself under a system prompt of ours.
    for field, value in (("temperature", "0"), ("max-tokens", "96")):
        driver.find_element(By.ID, field).clear()
        driver.find_element(By.ID, field).send_keys(value)
    for question in ("What is the capital of France?", "Why is the sky blue?"):
        driver.find_element(By.ID, "prompt").send_keys(question)
        driver.find_element(By.ID, "send").click()
        _wait(lambda: _replies_done(driver))
    driver.save_screenshot(str(png))
    print(f"wrote {png}")


def _replies_done(driver) -> bool:
    replies = driver.find_elements(By.CSS_SELECTOR, "#chat .message.assistant")
    return bool(replies) and all(r.get_attribute("data-finish") is not None for r in replies)


def _under_load(driver, url: str, args) -> None:
    done = threading.Event()
    clients = [threading.Thread(target=_client, args=(url, i, done), daemon=True) for i in range(args.concurrency)]
    for c in clients:
        c.start()
    try:
        driver.get(f"{url}/#dashboard")
        time.sleep(args.load_seconds)          # a screenshot of load, not a test: let the charts fill
        driver.set_window_size(1280, 1300)
        driver.execute_script("window.scrollTo(0, 0)")
        driver.save_screenshot(str(args.out / "console-dashboard.png"))
        print(f"wrote {args.out / 'console-dashboard.png'}")
        driver.find_element(By.CSS_SELECTOR, ".tab-button[data-tab='artifact']").click()
        driver.set_window_size(1280, 900)
        driver.save_screenshot(str(args.out / "console-artifact.png"))
        print(f"wrote {args.out / 'console-artifact.png'}")
    finally:
        done.set()
        for c in clients:
            c.join(timeout=120)


def _client(url: str, i: int, done: threading.Event) -> None:
    """Chat requests back to back, with varied questions and lengths; a 429 waits its Retry-After."""
    n = i
    with httpx.Client(timeout=300) as http:
        while not done.is_set():
            body = {"messages": [{"role": "system", "content": SYSTEM},
                                 {"role": "user", "content": QUESTIONS[n % len(QUESTIONS)]}],
                    "max_tokens": 48 + 32 * (n % 5), "temperature": 0.8}
            r = http.post(f"{url}/v1/chat/completions", json=body)
            if r.status_code == 429:
                done.wait(float(r.headers.get("retry-after", 1)))
            n += 1


if __name__ == "__main__":
    main()
