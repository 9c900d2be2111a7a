"""What both GPU backends (tensorrt, ort_cuda) share, all of it importable without a GPU.

device.py     DeviceInfo, the CUDA probe that guards every GPU library, and the thin device-memory
              layer (cudart through cuda-python) the TensorRT engine binds its buffers with
profiles.py   optimization profiles per bucket range, planned from the artifact's bucket grid
kv_copy.py    the new tokens' K/V into their pool slots as strided device-to-device copies
graphs.py     CUDA graphs per decode bucket: warm-up, capture, replay, the eager fallback
compat.py     the engine record's toolchain and device fields, and the refusal when they differ
(The build side they share, the Polygraphy comparison and the graph files, is kiln.compiler.backends.gpu.)
"""
