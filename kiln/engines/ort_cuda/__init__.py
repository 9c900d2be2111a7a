"""The ort-cuda engine backend: ONNX Runtime's CUDA provider with its PagedAttention contrib op.

paged_graph.py  kiln's standard graph -> packed tokens + com.microsoft PagedAttention per layer
checks.py       what a CPU can check of that graph: onnx.checker and ONNX Runtime's own schemas
build.py        the build step kiln.compiler.build registers: rewrite, check, save, compare on a GPU, record
feeds.py        PagedBatch -> the op's inputs (int32 lengths, -1-padded block table, slot mapping)
engine.py       OrtCudaEngine (Engine protocol): per-layer caches as CUDA OrtValues bound once
loader.py       the engine factory's loader: GPU and CUDA-provider checks
"""
