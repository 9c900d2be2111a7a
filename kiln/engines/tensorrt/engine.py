"""TrtEngine: the Engine protocol over a TensorRT execution context on one CUDA stream.

allocate_kv() puts the pool in device memory once and binds each layer's key/value cache by
address; execute() plans bucketed calls (calls.py), switches optimization profile only when a call
needs another one, sets the call's input shapes, enqueues the engine, and collects (the pool stays
on the device). A call in a decode profile runs as a CUDA graph (gpu/graphs.py): its block-table
width is padded up to a power of two so a bucket has few shapes, and the graph holds only the
engine's enqueue; uploads, the new K/V copies (their slots change every step) and the logits
download stay outside it, and a profile switch happens before a launch, never inside one.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from kiln.contract.engine import BucketGrid, EngineResult, KvLayout, PagedBatch
from kiln.engines.gpu.device import DeviceMemory
from kiln.engines.gpu.graphs import DecodeGraphs, pad_columns, padded_width
from kiln.engines.gpu.kv_copy import DevicePool
from kiln.engines.gpu.profiles import Profile
from kiln.engines.tensorrt.bindings import TrtBuffers, is_cache
from kiln.engines.tensorrt.calls import TrtCall, plan_trt_calls


class ExecutionContext(Protocol):
    """What TrtEngine asks of TensorRT (TrtContext); tests run the same graph behind it on ONNX Runtime."""

    def set_profile(self, index: int) -> None: ...

    def set_input_shape(self, name: str, shape: tuple[int, ...]) -> None: ...

    def set_tensor_address(self, name: str, address: int) -> None: ...

    def execute(self) -> None: ...


class TrtContext:
    """A deserialized TensorRT engine's execution context, enqueued on the device's stream."""

    def __init__(self, plan: bytes, stream: int):
        import tensorrt as trt

        self.stream = stream
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        self.engine = self._runtime.deserialize_cuda_engine(plan)
        if self.engine is None:
            raise RuntimeError("TensorRT could not deserialize the engine plan (see the TensorRT log above)")
        self.context = self.engine.create_execution_context()

    def set_profile(self, index: int) -> None:
        self.context.set_optimization_profile_async(index, self.stream)

    def set_input_shape(self, name: str, shape: tuple[int, ...]) -> None:
        if not self.context.set_input_shape(name, shape):
            raise ValueError(f"TensorRT refused shape {shape} for {name} in the active profile")

    def set_tensor_address(self, name: str, address: int) -> None:
        self.context.set_tensor_address(name, address)

    def execute(self) -> None:
        if not self.context.execute_async_v3(self.stream):
            raise RuntimeError("TensorRT execute_async_v3 failed (see the TensorRT log above)")


class TrtEngine:
    def __init__(self, context: ExecutionContext, record: dict, buckets: BucketGrid, kv_layout: KvLayout,
                 device: DeviceMemory, vocab_size: int, cuda_graphs: bool = True):
        self.buckets, self.kv_layout, self.device, self.vocab_size = buckets, kv_layout, device, vocab_size
        self.context = context
        self.graphs = DecodeGraphs(device, enabled=cuda_graphs, what="tensorrt engine")
        self.profiles = [Profile.from_dict(p) for p in record["profiles"]]
        self.io = record["io"]
        self.buffers = TrtBuffers(device, self.io, self.profiles, kv_layout.dtype)
        self.pool: DevicePool | None = None
        self._profile = -1

    @classmethod
    def from_plan(cls, plan: bytes, record: dict, buckets: BucketGrid, kv_layout: KvLayout,
                  device: DeviceMemory, vocab_size: int) -> "TrtEngine":
        return cls(TrtContext(plan, device.stream), record, buckets, kv_layout, device, vocab_size)

    def io_spec(self) -> dict[str, list]:
        return dict(self.io)

    def allocate_kv(self, num_blocks: int) -> None:
        if self.pool is not None:
            raise RuntimeError("allocate_kv() is called once; the KV pool is already on the device")
        limit = min(p.dims["num_blocks"][2] for p in self.profiles)
        if num_blocks > limit:
            raise ValueError(f"{num_blocks} KV blocks asked for, but this TensorRT engine was built for a pool of at "
                             f"most {limit} blocks (kiln build --kv-cache-memory); serve with a --kv-cache-memory "
                             f"no larger than the build's, or rebuild with a larger one")
        nbytes = DevicePool(self.kv_layout, num_blocks, 0).nbytes
        address = self.device.alloc(nbytes)
        # NOTE: zeroed: a NaN left in the unused tail of a block would survive the attention mask.
        self.device.memset(address, 0, nbytes)
        self.pool = DevicePool(self.kv_layout, num_blocks, address)
        self._bind_addresses()

    def _bind_addresses(self) -> None:
        """Every tensor's device address: the call buffers and each layer's slice of the pool.
        NOTE: set again after a profile switch, which may drop the context's bindings."""
        for name, address in self.buffers.address.items():
            self.context.set_tensor_address(name, address)
        for i in range(self.kv_layout.num_layers):
            for kind, name in enumerate(("key", "value")):
                self.context.set_tensor_address(f"{name}_cache.{i}", self.pool.cache_address(i, kind))

    def execute(self, batch: PagedBatch) -> EngineResult:
        if self.pool is None:
            raise RuntimeError("allocate_kv(num_blocks) must be called before execute()")
        calls = plan_trt_calls(batch, self.buckets, self.kv_layout.block_size, self.profiles)
        logits = np.empty((len(batch.logits_indices), self.vocab_size), np.float32)
        for call in calls:
            logits[call.call.logit_order] = self._run(call)
        return EngineResult(logits, sum(c.call.padded for c in calls), len(calls))

    def _run(self, call: TrtCall) -> np.ndarray:
        if call.profile != self._profile:
            self.context.set_profile(call.profile)
            self._bind_addresses()
            self._profile = call.profile
        feeds, key = self._graph_shape(call)
        for name, shape in self.buffers.stage(feeds).items():
            self.context.set_input_shape(name, shape)
        kv = self.kv_layout
        for name in (n for n in self.io if is_cache(n)):
            self.context.set_input_shape(name, (kv.num_kv_heads, self.pool.num_blocks, kv.block_size, kv.head_dim))
        self.graphs.run(key, self.context.execute)
        return self.buffers.collect(call.call, self.pool, self.vocab_size)

    def _graph_shape(self, call: TrtCall) -> tuple[dict[str, np.ndarray], tuple | None]:
        """The call's feeds and its graph key: a decode call's block table padded to a power-of-two
        width (zeros: block 0, never read past a sequence's length); other calls have no key."""
        profile = self.profiles[call.profile]
        feeds = call.call.feeds
        if not (self.graphs.enabled and profile.is_decode):
            return feeds, None
        width = padded_width(feeds["block_tables"].shape[1], profile.dims["max_blocks"][2])
        feeds = {**feeds, "block_tables": pad_columns(feeds["block_tables"], width, 0)}
        return feeds, (call.profile, *feeds["input_ids"].shape, width, feeds["logits_index"].shape[1])
