"""The openvino engine backend: OpenVINO's CPU paged-attention operation under kiln's runtime.
Load-and-run only; its build side is kiln.compiler.backends.openvino.

paged_graph   the rewrite to packed tokens + PagedAttentionExtension (per-layer windows), run at build
engine.py     OpenVinoEngine (Engine protocol): owns the KV cache tensors, one infer per step
feeds.py      PagedBatch -> the operation's inputs
loader.py     the registered loader: file, release and KV-cache checks, then import the build's
              compiled blob (where the plugin refuses it: rewrite and compile the IR)
options.py    the recorded precisions (compute, KV cache) and weight compression
"""
