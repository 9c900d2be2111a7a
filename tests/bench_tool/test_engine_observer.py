"""The in-process observer reads the engine client's snapshot only (never the engine core): queue
lengths at every sample, one batch size per new step, speculation differenced over the level."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from types import SimpleNamespace

from kiln.bench.observe import EngineObserver
from kiln.runtime.engine_stats import EngineSnapshot


def _observe(client, snapshots):
    """Sample once per snapshot, the client publishing each in turn; the level's view."""
    observer = EngineObserver(client, interval=0.0)

    async def go():
        for snapshot in snapshots:
            client.snapshot = snapshot
            await observer.sample()
    asyncio.run(go())
    return observer.view()


def test_samples_queues_and_the_batch_of_each_new_step():
    start = EngineSnapshot(steps=10, last_batch_size=2)
    client = SimpleNamespace(snapshot=start)
    view = _observe(client, [
        replace(start, num_waiting=3, num_running=1),                   # no new step: no batch
        replace(start, steps=12, last_batch_size=4, num_running=4),
        replace(start, steps=12, last_batch_size=4, num_running=4),     # the same step again
        replace(start, steps=13, last_batch_size=0),                    # scheduled nothing: no batch
        replace(start, steps=14, last_batch_size=6, num_running=6),
    ])
    assert view.source == "engine (sampled)" and view.server_ttft_mean is None
    assert view.queue_depth.n == 5 and view.queue_depth.max == 3
    assert view.running.max == 6 and view.batch_size.n == 2 and view.batch_size.mean == 5
    assert view.speculative_proposed is None and view.acceptance_rate is None


def test_speculation_is_counted_from_the_observers_start():
    start = EngineSnapshot(speculative=True, speculative_proposed=100, speculative_accepted=40)
    client = SimpleNamespace(snapshot=start)
    view = _observe(client, [replace(start, speculative_proposed=160, speculative_accepted=70)])
    assert (view.speculative_proposed, view.speculative_accepted) == (60, 30) and view.acceptance_rate == 0.5
