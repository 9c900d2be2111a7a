"""Decode steps on copies of the paged model compiled for their batch size (decode_models.py).

A copy must give the dynamic model's logits bit for bit (the same kernels on the same shapes), be
made only for a size that recurs, never take a step that is not decodes only, and give way to a
size that recurs when it no longer does (not sooner than SETTLE_STEPS after the last copy). A copy that fails to compile leaves its steps on the
dynamic model.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("openvino")

from kiln.compiler.backends.openvino.compile import compile_openvino  # noqa: E402
from kiln.contract.engine import BucketGrid, KvLayout, PagedBatch  # noqa: E402
from kiln.engines.openvino import decode_models  # noqa: E402
from kiln.engines.openvino.decode_models import RECENT_STEPS, RECURS, copies_allowed  # noqa: E402
from kiln.engines.openvino.loader import open_openvino  # noqa: E402
from openvino_testing import standard_graph  # noqa: E402

VOCAB_TOKENS = 100


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    spec, model = standard_graph("tiny-llama")
    root = tmp_path_factory.mktemp("ov-decode-copies")
    record = compile_openvino(model, spec, root / "engines" / "openvino")[0]
    return spec, record, root


def _engine(built, copies: str, monkeypatch) -> object:
    spec, record, root = built
    monkeypatch.setenv(decode_models.COPIES_ENV, copies)
    engine = open_openvino(root, record, spec, BucketGrid(), KvLayout(**record["kv_layout"]), threads=2)
    engine.allocate_kv(64)
    return engine


class Decodes:
    """B sequences, each on blocks of its own, decoding one token a step after a prompt of `past`."""

    def __init__(self, batch_size: int, past: int, block_size: int, first_block: int = 0):
        self.b, self.done, self.block_size = batch_size, past, block_size
        per = 8                                        # blocks each sequence may span (up to 8 * 32 tokens)
        self.tables = [np.arange(first_block + i * per, first_block + (i + 1) * per) for i in range(batch_size)]
        rng = np.random.default_rng(batch_size)
        self.tokens = rng.integers(0, VOCAB_TOKENS, (batch_size, past + RECENT_STEPS * 3))

    def prefill(self) -> PagedBatch:
        return self._batch(self.done, from_start=True)

    def step(self) -> PagedBatch:
        return self._batch(1)

    def _batch(self, n: int, from_start: bool = False) -> PagedBatch:
        start = 0 if from_start else self.done
        positions = np.arange(start, start + n)
        ids = np.concatenate([self.tokens[b, positions] for b in range(self.b)])
        slots = np.concatenate([t[positions // self.block_size] * self.block_size + positions % self.block_size
                                for t in self.tables])
        if not from_start:
            self.done += n
        query = np.full(self.b, n)
        return PagedBatch(ids.astype(np.int64), np.tile(positions, self.b), query, np.full(self.b, start),
                          self.tables, slots, np.cumsum(query) - 1)


def _run(engine, decodes: Decodes, steps: int) -> list[np.ndarray]:
    return [engine.execute(decodes.step()).logits for _ in range(steps)]


def test_a_recurring_decode_size_runs_on_its_copy_with_the_same_logits(built, monkeypatch):
    copied, dynamic = _engine(built, "4", monkeypatch), _engine(built, "0", monkeypatch)
    assert dynamic.decode_models is None
    runs = {}
    for name, engine in (("copied", copied), ("dynamic", dynamic)):
        decodes = Decodes(5, past=30, block_size=engine.block_size)
        engine.execute(decodes.prefill())
        runs[name] = _run(engine, decodes, RECURS)
        if engine.decode_models is not None:
            engine.decode_models.wait()
        runs[name] += _run(engine, decodes, 8)      # these on the copy, across a block boundary (past 46..)
    assert copied.decode_models.sizes() == [5]
    for got, want in zip(runs["copied"], runs["dynamic"]):
        np.testing.assert_array_equal(got, want)


def test_steps_that_are_not_all_decodes_stay_on_the_dynamic_model(built, monkeypatch):
    engine = _engine(built, "4", monkeypatch)
    decodes = Decodes(3, past=4, block_size=engine.block_size)
    engine.execute(decodes.prefill())
    for _ in range(RECURS * 2):                     # 3 sequences of 2 tokens: never a decode step
        engine.execute(decodes._batch(2))
    engine.decode_models.wait()
    assert engine.decode_models.sizes() == []


def test_a_size_that_stops_recurring_gives_way_once_the_last_copy_settled(built, monkeypatch):
    settle = RECENT_STEPS * 2
    monkeypatch.setattr(decode_models, "SETTLE_STEPS", settle)
    engine = _engine(built, "1", monkeypatch)
    first = Decodes(2, past=3, block_size=engine.block_size)
    engine.execute(first.prefill())
    _run(engine, first, RECURS)                     # the copy for 2 is asked for at step RECURS
    engine.decode_models.wait()
    assert engine.decode_models.sizes() == [2]
    second = Decodes(4, past=3, block_size=engine.block_size, first_block=16)
    engine.execute(second.prefill())
    _run(engine, second, RECENT_STEPS)              # size 2 has left the recent steps, but too soon after its copy
    engine.decode_models.wait()
    assert engine.decode_models.sizes() == [2]
    _run(engine, second, RECURS + settle - RECENT_STEPS)
    engine.decode_models.wait()
    assert engine.decode_models.sizes() == [4]


def test_a_copy_that_fails_to_compile_leaves_its_size_on_the_dynamic_model(built, monkeypatch, caplog):
    spec, record, root = built
    engine = _engine(built, "2", monkeypatch)
    model_file = root / record["file"]
    hidden = model_file.with_suffix(".hidden")
    decodes = Decodes(3, past=5, block_size=engine.block_size)
    engine.execute(decodes.prefill())
    model_file.rename(hidden)                       # the IR a copy compiles from is gone
    try:
        with caplog.at_level(logging.WARNING, logger="kiln"):
            logits = _run(engine, decodes, RECURS)
            engine.decode_models.wait()
            logits += _run(engine, decodes, RECURS)
            engine.decode_models.wait()
    finally:
        hidden.rename(model_file)
    assert engine.decode_models.sizes() == []
    assert sum("could not compile a copy of the model for 3 decodes" in r.message for r in caplog.records) == 1
    assert all(np.isfinite(x).all() for x in logits)


def test_the_number_of_copies_is_a_count(monkeypatch):
    monkeypatch.setenv(decode_models.COPIES_ENV, "two")
    with pytest.raises(ValueError, match="KILN_DECODE_COPIES='two'"):
        copies_allowed()
    monkeypatch.delenv(decode_models.COPIES_ENV)
    assert copies_allowed() == decode_models.MOST_COPIES


def test_a_process_that_ends_while_a_copy_compiles_exits_cleanly(built, tmp_path):
    """The steps run on a daemon thread, as LLM's engine loop does; the process ends right after the
    step that starts a copy's compile (the plugin aborted the process here when the compile thread
    was a daemon too)."""
    spec, record, root = built
    (tmp_path / "record.json").write_text(json.dumps(record))
    script = tmp_path / "ends_while_compiling.py"
    script.write_text(textwrap.dedent(f"""
        import json, pathlib, sys, threading
        sys.path[:0] = {[str(Path(__file__).parent), *sys.path]!r}
        from kiln.contract.engine import BucketGrid, KvLayout
        from kiln.engines.openvino.loader import open_openvino
        from kiln.engines.openvino.decode_models import RECURS
        from openvino_testing import standard_graph
        from test_openvino_decode_models import Decodes
        spec, _ = standard_graph("tiny-llama")
        record = json.loads(pathlib.Path({str(tmp_path / "record.json")!r}).read_text())
        engine = open_openvino(pathlib.Path({str(root)!r}), record, spec, BucketGrid(),
                               KvLayout(**record["kv_layout"]), threads=2)
        engine.allocate_kv(64)

        def steps():
            decodes = Decodes(3, past=5, block_size=engine.block_size)
            engine.execute(decodes.prefill())
            for _ in range(RECURS):
                engine.execute(decodes.step())

        loop = threading.Thread(target=steps, daemon=True)
        loop.start()
        loop.join()
        assert engine.decode_models._compiling == 3, "the copy should still be compiling"
        print("ending", flush=True)
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ending" in done.stdout
