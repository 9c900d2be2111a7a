"""The ort-cuda engine backend: ONNX Runtime's CUDA provider with its PagedAttention contrib op.
Load-and-run only; its build side (the paged graph, CPU checks, the build step) is
kiln.compiler.backends.ort_cuda.

feeds.py        PagedBatch -> the op's inputs (int32 lengths, -1-padded block table, slot mapping)
engine.py       OrtCudaEngine (Engine protocol): per-layer caches as CUDA OrtValues bound once
loader.py       the registered loader: GPU and CUDA-provider checks
"""
