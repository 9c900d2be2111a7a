"""kiln bench reports speculative decoding's acceptance over each level, from /metrics (the
counters' increase between the level's first and last scrape)."""

from __future__ import annotations

import asyncio

from kiln.bench.observe import MetricsObserver
from kiln.bench.report import _server_cells


def _text(proposed: float, accepted: float) -> str:
    return ("# TYPE kiln_speculative_proposed_tokens counter\n"
            f"kiln_speculative_proposed_tokens_total {proposed}\n"
            "# TYPE kiln_speculative_accepted_tokens counter\n"
            f"kiln_speculative_accepted_tokens_total {accepted}\n")


def test_acceptance_over_a_level_is_the_counters_increase():
    texts = iter([_text(100, 40), _text(300, 190)])

    async def scrape():
        return next(texts)
    observer = MetricsObserver(scrape, interval=1.0)
    asyncio.run(observer.sample())
    asyncio.run(observer.sample())
    view = observer.view()
    assert (view.speculative_proposed, view.speculative_accepted) == (200, 150)
    assert view.acceptance_rate == 0.75

    class Level:
        server = view
    assert _server_cells(Level)[2] == "150/200 (75%)"


def test_a_server_without_speculation_reports_none():
    async def scrape():
        return "# TYPE kiln_requests_running gauge\nkiln_requests_running 1\n"
    observer = MetricsObserver(scrape, interval=1.0)
    asyncio.run(observer.sample())
    view = observer.view()
    assert view.speculative_proposed is None and view.acceptance_rate is None
