"""ONNX Runtime engine (CPU, the embedded default): compile offline, load without optimizing."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnxruntime as ort

from kiln.engines.base import BucketGrid, KvLayout

MODEL_FILE = "model.onnx"


def default_threads() -> int:
    # NOTE: physical cores would be better; os.sched_getaffinity respects container limits.
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return os.cpu_count() or 1


def _options(threads: int, level: ort.GraphOptimizationLevel) -> ort.SessionOptions:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.graph_optimization_level = level
    opts.log_severity_level = 3
    # Every step has a new shape: memory patterns never repeat, and the arena keeps the peak of
    # every shape seen (RSS ratchets up by hundreds of MB). Measured on SmolLM2 int8 over six
    # mixed shapes: +151 MiB with the arena, +54 MiB without, decode and prefill times unchanged.
    opts.enable_mem_pattern = False
    opts.enable_cpu_mem_arena = False
    return opts


def compile_ort(model_bytes: bytes, out_dir: Path) -> Path:
    """Run ORT's graph optimizations once and save the result, so loading does none.

    ENABLE_EXTENDED, not ENABLE_ALL: level-3 layout rewrites are specific to the build machine's
    hardware, and the artifact must run on other CPUs.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / MODEL_FILE
    opts = _options(1, ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED)
    opts.optimized_model_filepath = str(target)
    # NOTE: kiln's cleanup pass already folded constants. ORT's folding would also fold the
    # Reshape that lets a tied embedding share the LM head's quantized table, saving a second
    # copy of the table (33 MB for SmolLM2 int4, 20% of the artifact).
    ort.InferenceSession(model_bytes, opts, providers=["CPUExecutionProvider"],
                         disabled_optimizers=["ConstantFolding"])
    return target


class OrtEngine:
    def __init__(self, model_path: Path, buckets: BucketGrid, kv_layout: KvLayout, threads: int | None = None):
        self.buckets, self.kv_layout = buckets, kv_layout
        self.threads = threads or default_threads()
        opts = _options(self.threads, ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
        self.session = ort.InferenceSession(str(model_path), opts, providers=["CPUExecutionProvider"])
        self._input_names = [i.name for i in self.session.get_inputs()]
        self._output_names = [o.name for o in self.session.get_outputs()]

    def io_spec(self) -> dict[str, list]:
        return {i.name: list(i.shape) for i in [*self.session.get_inputs(), *self.session.get_outputs()]}

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        outs = self.session.run(self._output_names, feeds)
        return dict(zip(self._output_names, outs))
