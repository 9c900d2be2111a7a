"""The GPU as kiln sees it: what device this is, and memory the engines bind by address.

NOTE: every GPU library (TensorRT, cudart, onnxruntime's CUDA provider) is imported lazily and
only after cuda_device_count() found a device. TensorRT 11's Runtime does not raise without a GPU:
it logs CUDA error 35 and crashes the process later (notes on this machine), so the probe runs
first and uses the driver library directly through ctypes.
"""

from __future__ import annotations

import ctypes
from dataclasses import asdict, dataclass
from typing import Protocol

import numpy as np

from kiln.engines.gpu.graphs import CaptureFailed


@dataclass(frozen=True)
class DeviceInfo:
    name: str                     # "NVIDIA H200"
    compute_capability: str       # "9.0": a TensorRT engine runs only on this SM version
    memory_bytes: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


class NoGpuError(RuntimeError):
    """No usable CUDA device or library; the message says what is missing."""


def cuda_device_count() -> int:
    """Devices the CUDA driver sees; 0 without a driver (no libcuda) or without a device."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


def require_cuda(what: str) -> None:
    if cuda_device_count() == 0:
        raise NoGpuError(f"{what} needs a CUDA GPU, and this machine has none (no libcuda.so.1 or no "
                         "device); run it on a machine with an NVIDIA GPU and its driver")


def _cudart():
    try:
        from cuda.bindings import runtime as cudart      # cuda-python >= 12.6
    except ImportError:
        try:
            from cuda import cudart                      # older cuda-python layout
        except ImportError:
            raise NoGpuError("the TensorRT engine needs cuda-python: pip install 'kiln[gpu]'") from None
    return cudart


def _check(result):
    """cudart calls return (error, *values); raise on an error, return the values."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"CUDA error {int(err)} ({err})")
    return values[0] if len(values) == 1 else values


class DeviceMemory(Protocol):
    """The few device operations the TensorRT engine needs; addresses are plain ints."""
    info: DeviceInfo
    stream: int

    def alloc(self, nbytes: int) -> int: ...

    def upload(self, address: int, array: np.ndarray) -> None: ...

    def download(self, address: int, out: np.ndarray) -> None: ...

    def memset(self, address: int, value: int, nbytes: int) -> None: ...

    def copy_2d(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int) -> None: ...

    def synchronize(self) -> None: ...

    def host_buffer(self, nbytes: int) -> np.ndarray:
        """Page-locked host memory (uint8): uploads from it are true async copies."""
        ...

    def capture(self, enqueue) -> object:
        """A CUDA graph of what enqueue() puts on the stream (not run); raises if it cannot be captured."""
        ...

    def launch(self, graph: object) -> None: ...


class CudaMemory:
    """DeviceMemory on a real GPU through cudart: one stream, allocations freed on close()."""

    def __init__(self, device: int = 0):
        require_cuda("the TensorRT engine")
        self._rt = _cudart()
        _check(self._rt.cudaSetDevice(device))
        self.info = probe_device(device)
        self.stream = int(_check(self._rt.cudaStreamCreate()))
        self._allocations: list[int] = []
        self._host: list[int] = []
        self._graphs: list[tuple] = []

    def alloc(self, nbytes: int) -> int:
        address = int(_check(self._rt.cudaMalloc(max(nbytes, 1))))
        self._allocations.append(address)
        return address

    def upload(self, address: int, array: np.ndarray) -> None:
        # NOTE: from pageable host memory cudaMemcpyAsync stages the bytes before returning (the
        # caller's array may then be freed); from host_buffer() memory it is a true async copy, and
        # the engines reuse that buffer only after the step's download has synchronized.
        a = np.ascontiguousarray(array)
        _check(self._rt.cudaMemcpyAsync(address, a.ctypes.data, a.nbytes,
                                        self._rt.cudaMemcpyKind.cudaMemcpyHostToDevice, self.stream))

    def download(self, address: int, out: np.ndarray) -> None:
        _check(self._rt.cudaMemcpyAsync(out.ctypes.data, address, out.nbytes,
                                        self._rt.cudaMemcpyKind.cudaMemcpyDeviceToHost, self.stream))
        self.synchronize()

    def memset(self, address: int, value: int, nbytes: int) -> None:
        _check(self._rt.cudaMemsetAsync(address, value, nbytes, self.stream))

    def copy_2d(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int) -> None:
        _check(self._rt.cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, height,
                                          self._rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice, self.stream))

    def synchronize(self) -> None:
        _check(self._rt.cudaStreamSynchronize(self.stream))

    def host_buffer(self, nbytes: int) -> np.ndarray:
        address = int(_check(self._rt.cudaMallocHost(max(nbytes, 1))))
        self._host.append(address)
        return np.ctypeslib.as_array((ctypes.c_uint8 * max(nbytes, 1)).from_address(address))

    def capture(self, step) -> object:
        # NOTE: the step runs once uncaptured first: it is this call's work, and TensorRT applies a
        # shape change on the first enqueue after it, which a capture must not hold.
        step()
        try:
            return self._captured(step)
        except Exception as e:      # cudart and TensorRT raise their own types
            raise CaptureFailed(str(e)) from None

    def _captured(self, step) -> object:
        rt = self._rt
        # NOTE: thread-local mode: another thread's CUDA calls neither join nor break this capture.
        _check(rt.cudaStreamBeginCapture(self.stream, rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal))
        try:
            step()
        finally:
            err, graph = rt.cudaStreamEndCapture(self.stream)     # always: the stream leaves capture mode
        _check((err, graph))
        executable = _check(rt.cudaGraphInstantiate(graph, 0))
        self._graphs.append((graph, executable))
        return executable

    def launch(self, graph: object) -> None:
        _check(self._rt.cudaGraphLaunch(graph, self.stream))

    def close(self) -> None:
        for graph, executable in self._graphs:
            self._rt.cudaGraphExecDestroy(executable)
            self._rt.cudaGraphDestroy(graph)
        for address in self._host:
            self._rt.cudaFreeHost(address)
        for address in self._allocations:
            self._rt.cudaFree(address)
        self._graphs.clear()
        self._host.clear()
        self._allocations.clear()


def probe_device(device: int = 0) -> DeviceInfo:
    """This machine's GPU, for the engine record and the load-time check."""
    require_cuda("probing the GPU")
    rt = _cudart()
    props = _check(rt.cudaGetDeviceProperties(device))
    name = props.name.decode() if isinstance(props.name, bytes) else str(props.name)
    return DeviceInfo(name.rstrip("\x00"), f"{props.major}.{props.minor}", int(props.totalGlobalMem))
