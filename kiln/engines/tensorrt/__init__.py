"""The tensorrt engine backend: kiln's paged-gather graph compiled by TensorRT, one optimization
profile per bucket range, the KV pool in device memory bound once. Load-and-run only; the build
side (the graph in the precision asked for, int4 weights, compile, checks) is
kiln.compiler.backends.tensorrt.

library.py   the TensorRT import, guarded
calls.py     a PagedBatch as TensorRT calls: bucketed [B, S] calls, a profile each, split by rows
bindings.py  device buffers sized for the largest profile; staging inputs (page-locked), collecting outputs
engine.py    TrtEngine (Engine protocol): execution context, CUDA stream, profile switches, CUDA graphs
loader.py    the registered loader: TensorRT release and device checks, then deserialize
"""
