"""kiln's kernel library: the C++ arithmetic both op libraries compile in.

The ONNX Runtime custom ops (kiln/engines/ort/native: kiln.MatMulQ4Min, kiln.MatMulQ8,
kiln.PagedAttention) and the OpenVINO extension (kiln/engines/openvino/native: kiln.LinearI8,
kiln.GateUpI8) are registrations only; what they compute is here (kernels.h says where each part is).
build.py compiles it once and links both libraries.
"""
