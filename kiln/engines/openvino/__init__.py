"""The openvino engine backend: OpenVINO's CPU paged-attention operation under kiln's runtime.

compile.py    build side: kiln's standard graph -> IR with marked attention cuts + engine record
weights.py    NNCF weight compression (int8 per channel, int4 symmetric groups of 32)
paged_graph   the rewrite to packed tokens + PagedAttentionExtension, run at load
engine.py     OpenVinoEngine (Engine protocol): owns the KV cache tensors, one infer per step
feeds.py      PagedBatch -> the operation's inputs
loader.py     the engine factory's loader: file, release and KV-cache checks, then compile
options.py    the recorded precisions (compute, KV cache) and weight compression
"""
