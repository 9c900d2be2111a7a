"""ONNX Runtime sessions on CPU: the one place that names the provider and the session options."""

from __future__ import annotations

import onnxruntime as ort

from kiln.engines.ort import native


CPU_PROVIDERS = ["CPUExecutionProvider"]


def session_options(threads: int = 1,
                    level: ort.GraphOptimizationLevel = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
                    ) -> ort.SessionOptions:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.graph_optimization_level = level
    opts.log_severity_level = 3
    # Every step has a new shape: memory patterns never repeat, and the arena keeps the peak of
    # every shape seen (RSS ratchets up by hundreds of MB). Measured on SmolLM2 int8 over mixed
    # shapes, RSS grew far less without the arena, decode and prefill times unchanged
    # (docs/results/2026-12-06-figures-from-code-comments.md).
    opts.enable_mem_pattern = False
    opts.enable_cpu_mem_arena = False
    return opts


def cpu_session(model, opts: ort.SessionOptions | None = None, **kwargs) -> ort.InferenceSession:
    """model: a path or serialized bytes. kiln's custom-op library (native/) is registered when it is
    built, so a graph with kiln.MatMulQ4Min nodes loads; one without them is unaffected."""
    opts = opts or session_options()
    native.register(opts)
    return ort.InferenceSession(model, opts, providers=CPU_PROVIDERS, **kwargs)
