"""Device buffers for a TensorRT engine's per-call tensors, and the host side of one call.

Every input and output except the KV pool gets one device buffer, allocated once at the largest
size any optimization profile allows, so each tensor keeps one address (what a CUDA graph
replays). A call stages its feeds in page-locked host buffers of the same sizes, uploads them into
the start of each device buffer, runs, then downloads only the logits (into a page-locked buffer
too) and moves new_kv into the pool on the device (gpu/kv_copy.py). So the pool never crosses to
the host, and a step allocates nothing on either side.
"""

from __future__ import annotations

import numpy as np

from kiln.engines.gpu.device import DeviceMemory
from kiln.engines.gpu.kv_copy import DevicePool, copy_new_kv
from kiln.engines.gpu.profiles import Profile
from kiln.engines.ort.batching import OrtCall

CACHE_PREFIXES = ("key_cache.", "value_cache.")
# Every input but the pool is int64 (compiler/passes/kv_io.py); new_kv has the pool's element type.
OUTPUT_DTYPES = {"logits": np.float32}
DEVICE_ONLY = "new_kv"          # the one tensor the host never stages nor reads


def is_cache(name: str) -> bool:
    return name.startswith(CACHE_PREFIXES)


def max_elements(dims: list, profiles: list[Profile]) -> int:
    """The most elements a tensor of these dims (ints or dim names) holds under any profile."""
    return max(int(np.prod([d if isinstance(d, int) else p.dims[d][2] for d in dims])) for p in profiles)


class TrtBuffers:
    def __init__(self, device: DeviceMemory, io: dict[str, list], profiles: list[Profile], kv_dtype: str):
        self.device = device
        dtypes = {**OUTPUT_DTYPES, "new_kv": kv_dtype}
        self.dtypes = {name: np.dtype(dtypes.get(name, np.int64)) for name in io if not is_cache(name)}
        sizes = {name: max_elements(io[name], profiles) * dtype.itemsize for name, dtype in self.dtypes.items()}
        self.address = {name: device.alloc(n) for name, n in sizes.items()}
        # NOTE: the host buffers are reused every call; the previous call's download synchronized
        # the stream, so its uploads from them are done.
        self.host = {name: device.host_buffer(n) for name, n in sizes.items() if name != DEVICE_ONLY}

    def host_view(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        dtype = self.dtypes[name]
        return self.host[name][:int(np.prod(shape)) * dtype.itemsize].view(dtype).reshape(shape)

    def stage(self, feeds: dict[str, np.ndarray]) -> dict[str, tuple[int, ...]]:
        """Upload the call's inputs through the host buffers; returns their shapes (set on the
        execution context)."""
        for name, array in feeds.items():
            staged = self.host_view(name, array.shape)
            staged[...] = array
            self.device.upload(self.address[name], staged)
        return {name: tuple(array.shape) for name, array in feeds.items()}

    def collect(self, call: OrtCall, pool: DevicePool, vocab_size: int) -> np.ndarray:
        """After the engine ran: new K/V into the pool (device to device), the wanted logits rows to the host."""
        batch, seq = call.feeds["input_ids"].shape
        copy_new_kv(self.device, pool, self.address["new_kv"], batch, seq, call.rows, call.cols, call.slots)
        logits = self.host_view("logits", (batch, call.feeds["logits_index"].shape[1], vocab_size))
        self.device.download(self.address["logits"], logits)
        return logits[call.logit_rows[:, 0], call.logit_rows[:, 1]]      # a copy: the buffer is reused
