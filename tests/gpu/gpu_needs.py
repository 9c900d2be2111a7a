"""GPU requirements as skips with a reason: tests marked `gpu` are collected everywhere and run
only where the hardware and libraries they need are present."""

from __future__ import annotations

import importlib.util

import pytest

from kiln.engines.gpu.device import cuda_device_count


def need_gpu(tensorrt: bool = False, ort_cuda: bool = False, cudart: bool = False) -> None:
    """Skip unless this machine has a CUDA device and the named libraries (checked in that order:
    no TensorRT object is made without a device, see kiln/engines/gpu/device.py)."""
    if cuda_device_count() == 0:
        pytest.skip("no CUDA GPU here (no libcuda.so.1 or no device)")
    if (tensorrt or cudart) and importlib.util.find_spec("cuda") is None:
        pytest.skip("cuda-python is not installed: pip install 'kiln[gpu]'")
    if tensorrt:
        try:
            import tensorrt  # noqa: F401
        except (ImportError, OSError) as e:
            pytest.skip(f"TensorRT is not usable here ({e}); pip install 'kiln[gpu]' where pypi.nvidia.com is reachable")
    if ort_cuda:
        import onnxruntime as ort

        if "CUDAExecutionProvider" not in ort.get_available_providers():
            pytest.skip("onnxruntime here is a CPU build; the README's GPU section installs onnxruntime-gpu")
