"""ONNX Runtime engine (CPU, the embedded default): compile offline, load without optimizing.

The graph gathers each sequence's past K/V from the paged pool (passes/kv_io.py) and returns the
new tokens' K/V, which this engine scatters into their pool slots in one vectorised write.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from kiln.engines.base import BucketGrid, EngineResult, KvLayout, PagedBatch
from kiln.engines.kv_pool import KvPool
from kiln.engines.ort_batching import OrtCall, plan_calls
from kiln.engines.ort_session import cpu_session, default_threads, session_options
from kiln.export.external import session_config

MODEL_FILE = "model.onnx"
WEIGHTS_FILE = MODEL_FILE + ".data"


def compile_ort(model: onnx.ModelProto, out_dir: Path) -> tuple[Path, Path | None]:
    """Run ORT's graph optimizations once and save the result, so loading does none.

    Returns (model.onnx, model.onnx.data or None): a model whose weights are external data
    (export.external) is saved with its large initializers in model.onnx.data beside it, so an
    engine of any size loads by path. ENABLE_EXTENDED, not ENABLE_ALL: level-3 layout rewrites are
    specific to the build machine's hardware, and the artifact must run on other CPUs.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    target, weights = out_dir / MODEL_FILE, out_dir / WEIGHTS_FILE
    opts = session_options(1, ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED)
    opts.optimized_model_filepath = str(target)
    for key, value in session_config(model, WEIGHTS_FILE).items():
        opts.add_session_config_entry(key, value)
    # NOTE: kiln's cleanup pass already folded constants. ORT's folding would also fold the
    # Reshape that lets a tied embedding share the LM head's quantized table, saving a second
    # copy of the table (33 MB for SmolLM2 int4, 20% of the artifact).
    cpu_session(model.SerializeToString(), opts, disabled_optimizers=["ConstantFolding"])
    return target, weights if weights.is_file() else None


class OrtEngine:
    def __init__(self, model_path: Path, buckets: BucketGrid, kv_layout: KvLayout, threads: int | None = None):
        self.buckets, self.kv_layout = buckets, kv_layout
        self.threads = threads or default_threads()
        opts = session_options(self.threads, ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
        self.session = cpu_session(str(model_path), opts)
        self.pool: KvPool | None = None

    def io_spec(self) -> dict[str, list]:
        return {i.name: list(i.shape) for i in [*self.session.get_inputs(), *self.session.get_outputs()]}

    def allocate_kv(self, num_blocks: int) -> None:
        self.pool = KvPool(self.kv_layout, num_blocks)

    def execute(self, batch: PagedBatch) -> EngineResult:
        if self.pool is None:
            raise RuntimeError("allocate_kv(num_blocks) must be called before execute()")
        calls = plan_calls(batch, self.buckets, self.kv_layout.block_size)
        logits = None
        for call in calls:
            rows = self._run(call)
            if logits is None:
                logits = np.empty((len(batch.logits_indices), rows.shape[-1]), np.float32)
            logits[call.logit_order] = rows
        return EngineResult(logits, sum(c.padded for c in calls), len(calls))

    def _run(self, call: OrtCall) -> np.ndarray:
        logits, new_kv = self.session.run(["logits", "new_kv"], call.feeds | self.pool.feeds)
        self.pool.write(new_kv, call.rows, call.cols, call.slots)
        return logits[call.logit_rows[:, 0], call.logit_rows[:, 1]]
