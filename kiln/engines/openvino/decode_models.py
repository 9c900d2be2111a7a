"""Decode steps on copies of the paged model compiled for their batch size.

The engine's model has dynamic shapes: every call, the CPU plugin infers each node's shape again
and prepares its kernels for it, kiln's own operations (which it runs through evaluate()) included.
A step of B decodes always has B tokens, B sequences and B rows of logits, so a copy of the model
with those dimensions fixed (only the block table's length left open) skips most of that work, and
gives the same logits bit for bit. What a copy costs: one compile of the IR (well under a second for SmolLM2 on two cores), its
own activations and prepacked constants (tens of MB), and, where the engine came from the build's
blob, a mapping of model.bin for the weights kiln's operations read (clean file pages, shared by
every copy and process, which the kernel may reclaim).

So the engine compiles a copy for a batch size once decode steps of that size recur, in a
background thread while the dynamic model keeps serving them, and keeps a few: a serving loop's
decode batch settles at one size or a few (the running set), and a size that stops recurring gives
its place to one that does. A copy that fails to compile is logged once and its size stays on
the dynamic model.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter, OrderedDict, deque
from typing import Callable

import openvino as ov

log = logging.getLogger("kiln")

RECENT_STEPS = 64        # the decode steps a size's recurrence is counted over
RECURS = 16              # steps of one size among the recent ones that earn it a copy
MOST_COPIES = 4          # copies kept at once; beyond, the least recently used one is dropped
SETTLE_STEPS = 2048      # with every place taken, decode steps between one copy and the next (a compile
                         # costs about a second of both cores: a drifting batch size must not pay it often)
COPIES_ENV = "KILN_DECODE_COPIES"     # how many copies an engine may keep; 0: none (every step dynamic)


def copies_allowed() -> int:
    value = os.environ.get(COPIES_ENV, "").strip()
    if not value:
        return MOST_COPIES
    if not value.isdigit():
        raise ValueError(f"{COPIES_ENV}={value!r}: expected how many decode copies to keep (0 for none)")
    return int(value)


def fixed_decode_shapes(batch_size: int) -> dict[str, ov.PartialShape]:
    """The paged model's per-step inputs, fixed for batch_size decodes (block_indices stays open:
    its length is the batch's total blocks)."""
    b = batch_size
    return {name: ov.PartialShape(shape) for name, shape in {
        "input_ids": [b], "position_ids": [b], "past_lens": [b], "subsequence_begins": [b + 1],
        "block_indices_begins": [b + 1], "max_context_len": [], "logits_indices": [b]}.items()}


class DecodeModels:
    """compile(batch_size) -> a compiled copy for that many decodes; bind(request) gives a new infer
    request the engine's KV cache. request_for() is called once per decode step, from one thread."""

    def __init__(self, compile: Callable[[int], ov.CompiledModel], bind: Callable[[ov.InferRequest], None],
                 most: int = MOST_COPIES):
        self._compile, self._bind, self.most = compile, bind, most
        self._recent: deque[int] = deque(maxlen=RECENT_STEPS)
        self._counts: Counter[int] = Counter()
        self._ready: OrderedDict[int, ov.InferRequest] = OrderedDict()     # least recently used first
        self._failed: set[int] = set()
        self._compiling: int | None = None
        self._steps = 0                                  # decode steps counted
        self._made_at = -SETTLE_STEPS                    # the step count when the last copy was asked for
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def sizes(self) -> list[int]:
        """The batch sizes with a compiled copy, least recently used first."""
        with self._lock:
            return list(self._ready)

    def request_for(self, batch_size: int) -> ov.InferRequest | None:
        """The copy's infer request for a step of batch_size decodes, or None (the dynamic model runs
        it); counts the step toward compiling a copy for its size."""
        self._count(batch_size)
        with self._lock:
            request = self._ready.get(batch_size)
            if request is not None:
                self._ready.move_to_end(batch_size)
                return request
            if self._wants(batch_size):
                self._compiling, self._made_at = batch_size, self._steps
                # NOTE: never a daemon (which it would be by default where the engine steps on a daemon
                # thread, as LLM's loop does): a process that ends while the plugin compiles aborts in
                # the plugin's teardown ("terminate called without an active exception"); Python waits
                # for this thread (well under a second) before it finalizes instead.
                self._thread = threading.Thread(target=self._make, args=(batch_size,), daemon=False,
                                                name=f"kiln-decode-copy-{batch_size}")
                self._thread.start()
        return None

    def wait(self) -> None:
        """Until no copy is being compiled (tests; a shutdown that wants a quiet machine)."""
        thread = self._thread
        if thread is not None:
            thread.join()

    def _count(self, batch_size: int) -> None:
        self._steps += 1
        if len(self._recent) == self._recent.maxlen:
            self._counts[self._recent[0]] -= 1
        self._recent.append(batch_size)
        self._counts[batch_size] += 1

    def _wants(self, batch_size: int) -> bool:
        """Under the lock: whether this step's size earns a copy now."""
        if self._compiling is not None or batch_size in self._failed or self._counts[batch_size] < RECURS:
            return False
        if len(self._ready) < self.most:
            return True
        # full: the least recently used copy gives way only when its size no longer recurs, and not
        # sooner than SETTLE_STEPS after the last copy
        return self._counts[next(iter(self._ready))] == 0 and self._steps - self._made_at >= SETTLE_STEPS

    def _make(self, batch_size: int) -> None:
        started = time.perf_counter()
        try:
            request = self._compile(batch_size).create_infer_request()
            self._bind(request)
        except Exception as e:                       # the dynamic model keeps the size: say so once
            log.warning("OpenVINO could not compile a copy of the model for %d decodes (%s); those steps stay on "
                        "the dynamic-shape model", batch_size, str(e).strip().splitlines()[-1] if str(e).strip() else e)
            with self._lock:
                self._failed.add(batch_size)
                self._compiling = None
            return
        with self._lock:
            if len(self._ready) >= self.most:
                self._ready.popitem(last=False)
            self._ready[batch_size] = request
            self._compiling = None
            sizes = list(self._ready)
        log.info("compiled a copy of the model for %d decodes in %.1f s; decode steps of %s sequences run on copies",
                 batch_size, time.perf_counter() - started, ", ".join(map(str, sorted(sizes))))
