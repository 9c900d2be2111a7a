"""Numeric comparison of two kiln engines with Polygraphy: same paged steps, per-output tolerances.

Each engine is wrapped as a Polygraphy runner whose feeds are a PagedBatch's fields, so any two
backends compare through the Engine protocol: the TensorRT or ONNX Runtime CUDA engine against the
ONNX Runtime CPU run of the same artifact. The steps run in order on each runner's own KV pool
(a prefill, then decodes that read what it wrote), so a wrong cache write shows in later logits.
On a CPU the same wiring compares two CPU engines (tests/gpu/test_gpu_records.py).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable

import numpy as np

from kiln.contract.engine import Engine, PagedBatch

FIELDS = ("input_ids", "positions", "query_lens", "past_lens", "slot_mapping", "logits_indices")
DEFAULT_TOLERANCES = {"logits": (1e-3, 1e-3)}         # (atol, rtol): fp32 engines


def batch_to_feeds(batch: PagedBatch) -> dict[str, np.ndarray]:
    """A PagedBatch as flat arrays (block tables padded with -1), the form Polygraphy feeds."""
    width = max((len(t) for t in batch.block_tables), default=1)
    tables = np.full((len(batch.block_tables), width), -1, np.int64)
    for b, t in enumerate(batch.block_tables):
        tables[b, :len(t)] = t
    return {**{f: np.asarray(getattr(batch, f), np.int64) for f in FIELDS}, "block_tables": tables}


def feeds_to_batch(feeds: dict[str, np.ndarray]) -> PagedBatch:
    tables = [row[row >= 0] for row in feeds["block_tables"]]
    return PagedBatch(block_tables=tables, **{f: feeds[f] for f in FIELDS})


def probe_steps(vocab_size: int, block_size: int, seed: int = 0) -> list[PagedBatch]:
    """Two sequences on scattered blocks: a mixed-length prefill, then two decode steps."""
    rng = np.random.default_rng(seed)
    lens = [block_size + 3, 5]
    tables = [np.array([7, 2, 9], np.int64), np.array([4, 11], np.int64)]
    steps, past = [], [0, 0]
    for new in (lens, [1, 1], [1, 1]):
        ids, pos, slots = [], [], []
        for b, n in enumerate(new):
            p = np.arange(past[b], past[b] + n)
            ids.append(rng.integers(0, vocab_size, n))
            pos.append(p)
            slots.append(tables[b][p // block_size] * block_size + p % block_size)
        last = np.cumsum(new) - 1
        steps.append(PagedBatch(np.concatenate(ids), np.concatenate(pos), np.array(new, np.int64),
                                np.array(past, np.int64), tables, np.concatenate(slots), last.astype(np.int64)))
        past = [a + n for a, n in zip(past, new)]
    return steps


def _base_runner():
    from polygraphy.backend.base import BaseRunner

    return BaseRunner


def engine_runner(name: str, make_engine: Callable[[], Engine], num_blocks: int = 16):
    """A Polygraphy runner over a kiln engine (made on activate, its KV pool allocated once)."""
    from polygraphy.common import TensorMetadata

    class EngineRunner(_base_runner()):
        def activate_impl(self):
            self.engine = make_engine()
            self.engine.allocate_kv(num_blocks)

        def get_input_metadata_impl(self):
            meta = TensorMetadata()
            for f in FIELDS:
                meta.add(f, np.int64, (None,))
            return meta.add("block_tables", np.int64, (None, None))

        def infer_impl(self, feed_dict):
            t0 = time.perf_counter()
            result = self.engine.execute(feeds_to_batch(feed_dict))
            self.inference_time = time.perf_counter() - t0
            return OrderedDict(logits=result.logits)

        def deactivate_impl(self):
            del self.engine

    return EngineRunner(name=name)


def compare_engines(reference, candidate, steps: list[PagedBatch],
                    tolerances: dict[str, tuple[float, float]] = DEFAULT_TOLERANCES) -> dict:
    """Run both runners over the steps and compare; returns a pass-report dict (never raises on a mismatch)."""
    from polygraphy.comparator import Comparator
    from polygraphy.comparator.compare import SimpleCompareFunc
    from polygraphy.logger import G_LOGGER

    func = SimpleCompareFunc(atol={k: a for k, (a, _) in tolerances.items()},
                             rtol={k: r for k, (_, r) in tolerances.items()}, check_error_stat="max")
    with G_LOGGER.verbosity(G_LOGGER.WARNING):
        results = Comparator.run([reference, candidate], data_loader=[batch_to_feeds(s) for s in steps])
        passed = bool(Comparator.compare_accuracy(results, compare_func=func))
    return {"name": f"compare {candidate.name} vs {reference.name}", "passed": passed,
            "tool": "polygraphy", "steps": len(steps), "outputs": _errors(results, tolerances)}


def _errors(results, tolerances) -> dict:
    (_, ref), (_, cand) = results[0], results[1]
    out = {}
    for name, (atol, rtol) in tolerances.items():
        diffs = [np.abs(np.asarray(c[name], np.float64) - np.asarray(r[name], np.float64)).max()
                 for r, c in zip(ref, cand)]
        out[name] = {"atol": atol, "rtol": rtol, "max_abs_error": float(max(diffs))}
    return out


def as_pass_report(compare: dict, nodes: int, seconds: float) -> dict:
    """A comparison in the manifest's pass-report form (kiln inspect's table), its details kept."""
    from kiln.compiler.passes.base import PassReport

    first = next(iter(compare["outputs"].values()))
    return PassReport(compare["name"], nodes, nodes, seconds, max_abs_error=first["max_abs_error"],
                      tolerance=first["atol"], details=compare).to_dict()
