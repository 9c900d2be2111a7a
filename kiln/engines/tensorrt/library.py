"""The TensorRT Python library, imported lazily: callers check for a GPU first (gpu/device.py says why)."""

from __future__ import annotations


def import_tensorrt():
    try:
        import tensorrt as trt
    except (ImportError, OSError) as e:
        raise RuntimeError(f"the tensorrt backend needs TensorRT ({e}); install it with pip install "
                           "'kiln[gpu]' where pypi.nvidia.com is reachable") from None
    return trt
