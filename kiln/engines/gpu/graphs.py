"""CUDA graphs per decode bucket: capture after warm-up, replay at fixed addresses, eager fallback.

A decode step launches many small kernels per layer, and at small batches launching them costs
more than they compute. A CUDA graph replays a captured launch sequence in one call, but only as
captured: the same kernels, device addresses and shapes. So, in both GPU engines:

- one graph per key: the decode bucket (batch, new tokens per sequence), the block-table width
  padded up to a power of two (it grows one block at a time; padded columns are never read), and
  whatever else fixes the engine's shapes. Prefill calls have no key and always run eagerly;
- every tensor a graph reads or writes stays at one device address (the engines allocate their
  call buffers once). Each step's inputs are staged on the host and uploaded before the launch,
  outside the graph, so a replay reads this step's values;
- a key's first WARMUP runs are plain runs: the libraries allocate scratch memory and pick
  kernels on first use, which a capture must not record. The next run does the step's work and
  captures it (GraphDevice.capture); later runs replay;
- a capture that fails (a library that synchronizes or allocates inside it, an op with no
  capturable kernel) leaves that key eager for good, with one log line saying so.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Hashable, Protocol

log = logging.getLogger("kiln.engines.gpu")

WARMUP = 1          # eager runs of a key before its capture


class CaptureFailed(RuntimeError):
    """No graph could be made of a step; work_done: whether the step's work was done all the same."""

    def __init__(self, message: str, work_done: bool = True):
        super().__init__(message)
        self.work_done = work_done


class GraphDevice(Protocol):
    """Graphs on the engine's stream (CudaMemory, ONNX Runtime's own graphs, FakeDevice in tests)."""

    def capture(self, step: Callable[[], None]) -> object:
        """Do the step's work and return a graph of it; CaptureFailed if none can be made."""
        ...

    def launch(self, graph: object) -> None: ...


def padded_width(width: int, most: int | None = None) -> int:
    """A block-table width padded up to a power of two, at most `most` (a profile's bound) if given."""
    padded = 1
    while padded < width:
        padded *= 2
    return max(width, padded if most is None else min(padded, most))


@dataclass
class GraphStats:
    eager: int = 0
    captured: int = 0
    replayed: int = 0
    failed: list = field(default_factory=list)       # keys whose capture failed


class DecodeGraphs:
    """The graph bookkeeping one engine keeps: per key, warm-up count, graph, or failed."""

    def __init__(self, device: GraphDevice, enabled: bool = True, warmup: int = WARMUP, what: str = "engine"):
        self.device, self.enabled, self.warmup, self.what = device, enabled, warmup, what
        self.graphs: dict[Hashable, object] = {}
        self.runs: dict[Hashable, int] = {}
        self.stats = GraphStats()

    def run(self, key: Hashable | None, eager: Callable[[], None], step: Callable[[], None] | None = None) -> str:
        """This call's work for `key` (None: not a graph shape); returns how it ran. eager runs
        it without graphs; step (default: eager) is what warms up and is captured."""
        step = step or eager
        if key is not None and key in self.graphs:
            self.device.launch(self.graphs[key])
            self.stats.replayed += 1
            return "replayed"
        if key is None or not self.enabled or key in self.stats.failed:
            eager()
            self.stats.eager += 1
            return "eager"
        if self.runs.get(key, 0) < self.warmup:
            self.runs[key] = self.runs.get(key, 0) + 1
            step()
            self.stats.eager += 1
            return "eager"
        return self._capture(key, step, eager)

    def _capture(self, key: Hashable, step: Callable[[], None], eager: Callable[[], None]) -> str:
        try:
            self.graphs[key] = self.device.capture(step)
        except CaptureFailed as e:
            if not e.work_done:
                eager()
            self.stats.failed.append(key)
            self.stats.eager += 1
            log.warning("%s: CUDA graph capture failed for decode bucket %s (%s); it runs eagerly from now on",
                        self.what, key, e)
            return "eager"
        self.stats.captured += 1
        return "captured"


def pad_columns(table, width: int, fill: int):
    """A [rows, w] table widened to `width` columns of `fill` (block tables for a graph's shape)."""
    import numpy as np

    if table.shape[1] >= width:
        return table
    out = np.full((table.shape[0], width), fill, table.dtype)
    out[:, :table.shape[1]] = table
    return out
