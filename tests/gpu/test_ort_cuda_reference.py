"""The ort-cuda graph around PagedAttention, run on a CPU: with a numpy reference of the op
(paged_attention_ref.py) standing in for the CUDA kernel, the rewritten tiny model must give the
`ort` engine's logits step by step (prefill, then decodes reading the cache the op wrote),
compared with Polygraphy at the fp16 tolerance the GPU comparison uses."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("onnxruntime_extensions")

import onnxruntime as ort  # noqa: E402
from onnxruntime_extensions import get_library_path  # noqa: E402
from paged_attention_ref import with_reference_op  # noqa: E402

from kiln.contract.artifact import EngineArtifact  # noqa: E402
from kiln.contract.engine import EngineResult  # noqa: E402
from kiln.engines.load import load_engine  # noqa: E402
from kiln.compiler.backends.gpu.compare import compare_engines, engine_runner, probe_steps  # noqa: E402
from kiln.compiler.backends.ort_cuda.build import TOLERANCES  # noqa: E402
from kiln.engines.ort_cuda.feeds import cuda_feeds  # noqa: E402
from kiln.compiler.backends.ort_cuda.paged_graph import cache_name, paged_attention_graph  # noqa: E402
from kiln.compiler.export.decoder_graph import build_decoder  # noqa: E402
from kiln.compiler.export.sources import load_source  # noqa: E402
from kiln.compiler.passes.fusion import fusion_passes  # noqa: E402


class ReferenceEngine:
    """The ort-cuda engine's feeds and cache handling, on ONNX Runtime CPU with the reference op."""

    def __init__(self, model, spec, block_size: int):
        opts = ort.SessionOptions()
        opts.register_custom_ops_library(get_library_path())
        self.session = ort.InferenceSession(with_reference_op(model).SerializeToString(), opts,
                                            providers=["CPUExecutionProvider"])
        self.spec, self.block_size = spec, block_size

    def allocate_kv(self, num_blocks: int) -> None:
        shape = (num_blocks, self.block_size, self.spec.num_kv_heads, self.spec.head_dim)
        self.num_blocks = num_blocks
        self.caches = {cache_name(kind, i): np.zeros(shape, np.float32)
                       for i in range(self.spec.num_layers) for kind in ("key", "value")}

    def execute(self, batch) -> EngineResult:
        names = ["logits", *(n.replace("_cache.", "_cache_out.") for n in self.caches)]
        logits, *caches = self.session.run(names, cuda_feeds(batch, self.block_size, self.num_blocks) | self.caches)
        self.caches = dict(zip(self.caches, caches))
        return EngineResult(logits)


def test_ort_cuda_graph_with_a_reference_op_matches_the_ort_engine(tiny_llama_standard_artifact):
    artifact = EngineArtifact.load(tiny_llama_standard_artifact)
    src = load_source("tiny-llama")
    model = build_decoder(src.spec, src.weights)
    for p in fusion_passes(src.spec):
        model = p.run(model)
    paged = paged_attention_graph(model, src.spec)
    bs = artifact.manifest.kv_layout.block_size
    steps = probe_steps(src.spec.vocab_size, bs)
    report = compare_engines(engine_runner("ort", lambda: load_engine(artifact)),
                             engine_runner("ort-cuda graph + reference op", lambda: ReferenceEngine(paged, src.spec, bs)),
                             steps, TOLERANCES)
    assert report["passed"], report
    assert 0 < report["outputs"]["logits"]["max_abs_error"] < 1e-2      # fp16 attention, not bit-equal
