"""The tensorrt engine backend: kiln's paged-gather graph compiled by TensorRT, one optimization
profile per bucket range, the KV pool in device memory bound once.

graph.py     build side, CPU: the kv_io graph in the precision asked for (fp16 in the graph, the KV
             pool included: TensorRT 11 networks are strongly typed)
weights.py   build side, CPU: --quant int4 as block-quantized DequantizeLinear + MatMul
compile.py   build side, GPU: parser -> network -> builder config (profiles, timing cache) -> plan
build.py     the build step kiln.compiler.build registers: graph, Polygraphy check on ONNX Runtime CPU,
             profiles, compile, Polygraphy check of the engine, record
calls.py     a PagedBatch as TensorRT calls: bucketed [B, S] calls, a profile each, split by rows
bindings.py  device buffers sized for the largest profile; staging inputs, collecting outputs
engine.py    TrtEngine (Engine protocol): execution context, CUDA stream, profile switches
loader.py    the engine factory's loader: TensorRT release and device checks, then deserialize
"""
