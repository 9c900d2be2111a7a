"""Device buffers for a TensorRT engine's per-call tensors, and the host side of one call.

Every input and output except the KV pool gets one device buffer, allocated once at the largest
size any optimization profile allows; a call uploads its feeds into the start of each, runs, then
downloads only the logits and moves new_kv into the pool on the device (gpu/kv_copy.py). So the
pool never crosses to the host, and a step allocates nothing.
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
        self.address = {name: device.alloc(max_elements(io[name], profiles) * dtype.itemsize)
                        for name, dtype in self.dtypes.items()}

    def stage(self, feeds: dict[str, np.ndarray]) -> dict[str, tuple[int, ...]]:
        """Upload the call's inputs; returns their shapes (set on the execution context)."""
        for name, array in feeds.items():
            self.device.upload(self.address[name], np.ascontiguousarray(array, self.dtypes[name]))
        return {name: tuple(array.shape) for name, array in feeds.items()}

    def collect(self, call: OrtCall, pool: DevicePool, vocab_size: int) -> np.ndarray:
        """After the engine ran: new K/V into the pool (device to device), the wanted logits rows to the host."""
        batch, seq = call.feeds["input_ids"].shape
        copy_new_kv(self.device, pool, self.address["new_kv"], batch, seq, call.rows, call.cols, call.slots)
        logits = np.empty((batch, call.feeds["logits_index"].shape[1], vocab_size), np.float32)
        self.device.download(self.address["logits"], logits)
        return logits[call.logit_rows[:, 0], call.logit_rows[:, 1]]
