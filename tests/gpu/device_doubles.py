"""Test doubles for hardware this machine lacks, kept thin.

FakeDevice: DeviceMemory over one host byte array: addresses are offsets into it (from a non-zero
base, so a forgotten address fails), copies are the byte moves cudart would do.
CUDA graphs on the FakeDevice: a capture runs the step once (its work, as CudaMemory's does) and
keeps it as the graph, and a launch runs it again; `refuse_capture` makes captures fail. Each run of
the OrtExecution records which graph launched it, with the shapes and addresses it read, so a test
can check that a graph's replays all read the same ones.
OrtExecution: TensorRT's ExecutionContext played by ONNX Runtime CPU on the same graph file,
reading its inputs from and writing its outputs to the FakeDevice's memory at the bound addresses,
so TrtEngine's staging, profile choice, pool binding and device KV copies run for real.
"""

from __future__ import annotations

import numpy as np

from kiln.engines.gpu.device import DeviceInfo
from kiln.engines.gpu.graphs import CaptureFailed

BASE = 0x10000
ALIGN = 256


class FakeDevice:
    def __init__(self, capacity: int = 64 << 20):
        self.info = DeviceInfo("Fake GPU", "9.0", capacity)
        self.stream = 7
        self.heap = np.zeros(capacity, np.uint8)
        self._next = 0
        self.copies = 0
        self.pinned: list[np.ndarray] = []
        self.uploads_from: list[tuple] = []            # (device address, host array) of each upload
        self.refuse_capture = False
        self.launches: list[object] = []
        self.launching = None               # the graph being launched, while it runs

    def _span(self, address: int, nbytes: int) -> slice:
        start = address - BASE
        if start < 0 or start + nbytes > self._next:
            raise ValueError(f"address {address:#x}+{nbytes} is outside the allocated device memory")
        return slice(start, start + nbytes)

    def alloc(self, nbytes: int) -> int:
        address = BASE + self._next
        self._next += -(-max(nbytes, 1) // ALIGN) * ALIGN
        if self._next > len(self.heap):
            raise MemoryError("fake device memory exhausted")
        return address

    def upload(self, address: int, array: np.ndarray) -> None:
        self.uploads_from.append((address, array))
        data = np.ascontiguousarray(array).view(np.uint8).reshape(-1)
        self.heap[self._span(address, data.size)] = data

    def download(self, address: int, out: np.ndarray) -> None:
        out.view(np.uint8).reshape(-1)[:] = self.heap[self._span(address, out.nbytes)]

    def memset(self, address: int, value: int, nbytes: int) -> None:
        self.heap[self._span(address, nbytes)] = value

    def copy_2d(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int) -> None:
        for h in range(height):
            self.heap[self._span(dst + h * dst_pitch, width)] = self.heap[self._span(src + h * src_pitch, width)]
        self.copies += 1

    def synchronize(self) -> None:
        pass

    def host_buffer(self, nbytes: int) -> np.ndarray:
        buffer = np.zeros(max(nbytes, 1), np.uint8)
        self.pinned.append(buffer)
        return buffer

    def capture(self, step) -> "FakeGraph":
        step()                                  # the call's work, uncaptured, as CudaMemory does
        if self.refuse_capture:
            raise CaptureFailed("operation not permitted when stream is capturing")
        return FakeGraph(step)

    def launch(self, graph: "FakeGraph") -> None:
        self.launches.append(graph)
        self.launching = graph
        try:
            graph.enqueue()
        finally:
            self.launching = None

    def view(self, address: int, shape, dtype) -> np.ndarray:
        """The device bytes at address as an array (a view: writes land in device memory)."""
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return self.heap[self._span(address, n)].view(dtype).reshape(shape)


class FakeGraph:
    def __init__(self, enqueue):
        self.enqueue = enqueue


class OrtExecution:
    """ExecutionContext over ONNX Runtime CPU and a FakeDevice (see the module docstring)."""

    def __init__(self, model_path, device: FakeDevice, output_dtypes: dict):
        from kiln.engines.ort.session import cpu_session

        self.session, self.device, self.output_dtypes = cpu_session(str(model_path)), device, output_dtypes
        self.inputs = {i.name: i for i in self.session.get_inputs()}
        self.addresses, self.shapes, self.profiles = {}, {}, []
        self.runs: list[tuple] = []         # (graph launched or None, input shapes, addresses) per run

    def set_profile(self, index: int) -> None:
        self.profiles.append(index)

    def set_input_shape(self, name, shape) -> None:
        self.shapes[name] = tuple(shape)

    def set_tensor_address(self, name, address) -> None:
        self.addresses[name] = address

    def execute(self) -> None:
        self.runs.append((self.device.launching, dict(self.shapes), dict(self.addresses)))
        dtype = {"tensor(int64)": np.int64, "tensor(float)": np.float32, "tensor(float16)": np.float16}
        feeds = {n: self.device.view(self.addresses[n], self.shapes[n], dtype[i.type]) for n, i in self.inputs.items()}
        names = list(self.output_dtypes)
        for name, value in zip(names, self.session.run(names, feeds)):
            self.device.upload(self.addresses[name], value.astype(self.output_dtypes[name]))
