"""What the browser tests do on the console page: wait for what a user would see, read it back."""

from __future__ import annotations

import time

from selenium.webdriver.common.by import By

WAIT_S = 30.0      # a loaded 2-core machine runs the server, Chromium and the test at once


def wait_for(predicate, what: str, timeout: float = WAIT_S, every: float = 0.1):
    """Poll until predicate() is truthy (returned); fail naming `what` after the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


class ConsolePage:
    def __init__(self, driver, url: str):
        self.driver = driver
        driver.get(f"{url}/")

    def by_id(self, element_id: str):
        return self.driver.find_element(By.ID, element_id)

    def value(self, element_id: str) -> str:
        """An element's data-value (tiles and live counters keep the number they show there)."""
        return self.by_id(element_id).get_attribute("data-value") or ""

    def series_max(self, chart: str, series: str) -> float:
        """The largest value a chart's series shows (0 before it is drawn). NOTE: read in one
        script, because the chart redraws every second and replaces its paths: an element found
        by one WebDriver call may be gone by the next."""
        value = self.driver.execute_script(
            "const p = document.querySelector(arguments[0]); return p ? p.dataset.max : null;",
            f"#chart-{chart} path[data-series='{series}']")
        return float(value or 0)

    def has_series(self, chart: str) -> bool:
        return self.driver.execute_script(
            "return document.querySelector(arguments[0]) !== null;", f"#chart-{chart} path[data-series]")

    def tab(self, name: str) -> None:
        self.driver.find_element(By.CSS_SELECTOR, f".tab-button[data-tab='{name}']").click()

    def set_field(self, element_id: str, value) -> None:
        field = self.by_id(element_id)
        field.clear()
        field.send_keys(str(value))

    def set_checked(self, element_id: str, checked: bool) -> None:
        box = self.by_id(element_id)
        if box.is_selected() != checked:
            box.click()

    def send(self, text: str) -> None:
        self.set_field("prompt", text)
        self.by_id("send").click()

    def replies(self) -> list:
        return self.driver.find_elements(By.CSS_SELECTOR, "#chat .message.assistant")

    def finished_reply(self):
        """The last reply, once it has ended (its data-finish says how)."""
        def done():
            replies = self.replies()
            return replies and replies[-1].get_attribute("data-finish") is not None and replies[-1]
        return wait_for(done, "the reply to finish")

    def watch_replies(self) -> None:
        """Count, in the page, the changes to reply text: a streamed reply grows once per delta, a
        reply shown whole changes once. (Changes, not repaints: how many repaints a loaded machine
        allows is timing, and a test must not depend on it.)"""
        self.driver.execute_script("""
            window.kilnTextUpdates = 0;
            const inReplyText = r => r.target.closest && r.target.closest('.message.assistant .text');
            new MutationObserver(records => { window.kilnTextUpdates += records.filter(inReplyText).length; })
                .observe(document.getElementById('chat'), {subtree: true, childList: true, characterData: true});
        """)

    def text_updates(self) -> int:
        return self.driver.execute_script("return window.kilnTextUpdates;")

    def stop_at_first_token(self) -> None:
        """Click Stop the moment a reply's first text shows. NOTE: in the page itself, because the
        tiny model writes a whole 900-token reply in about half a second: a click sent from the
        test would often arrive after the reply had ended."""
        self.driver.execute_script("""
            const chat = document.getElementById('chat');
            const observer = new MutationObserver(() => {
                const text = chat.querySelector('.message.assistant.streaming .text');
                if (text && text.textContent) { observer.disconnect(); document.getElementById('stop').click(); }
            });
            observer.observe(chat, {subtree: true, childList: true, characterData: true});
        """)
