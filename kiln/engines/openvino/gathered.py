"""OpenVinoGatherEngine: OpenVINO's compiled linears under kiln's own paged attention (a gather in the graph).

For the models OpenVINO's PagedAttentionExtension cannot compute (attention-score soft-capping,
Gemma 2), the openvino build compiles the graph the ort backend's standard core runs
(kiln.compiler.passes.kv_io, layout "paged-gather"): each layer gathers its sequences' blocks from
kiln's KV pool, attends with the family's own ops (soft-cap, windows, scales), and returns the new
tokens' K/V, which this engine scatters into their slots. OpenVINO still runs every linear with
its compressed weights and the recorded compute precision, the bulk of a step.

The calls are planned as on ort (padded [B, S] on the bucket grid, decodes apart from chunks), and
the pool is the ort engine's (kiln.engines.ort.kv_pool), bound to the request once.
"""

from __future__ import annotations

import numpy as np
import openvino as ov

from kiln.contract.engine import BucketGrid, EngineResult, KvLayout, PagedBatch
from kiln.engines.openvino.engine import GATHER_LAYOUT
from kiln.engines.openvino.options import OpenVinoOptions
from kiln.engines.ort.batching import OrtCall, assemble_logits, plan_calls
from kiln.engines.ort.kv_pool import KvPool

POOL_DTYPES = {"float32": "f32"}   # KvLayout dtype -> the cache inputs' OpenVINO type


class PoolMismatch(RuntimeError):
    """The compiled graph reads a KV pool other than the manifest's layout."""


def check_pool(compiled: ov.CompiledModel, kv_layout: KvLayout) -> None:
    want = POOL_DTYPES.get(kv_layout.dtype)
    caches = [i for i in compiled.inputs if i.get_any_name().startswith(("key_cache.", "value_cache."))]
    if want is None or len(caches) != 2 * kv_layout.num_layers:
        raise PoolMismatch(f"the compiled graph reads {len(caches)} cache inputs, the manifest's KV layout "
                           f"({kv_layout.dtype}, {kv_layout.num_layers} layers) asks for a float32 pool per layer")
    got = {i.get_element_type().get_type_name() for i in caches}
    if got != {want}:
        raise PoolMismatch(f"the compiled graph reads a {'/'.join(sorted(got))} KV pool, the manifest's layout is "
                           f"{kv_layout.dtype}")


class OpenVinoGatherEngine:
    def __init__(self, compiled: ov.CompiledModel, buckets: BucketGrid, kv_layout: KvLayout,
                 options: OpenVinoOptions, blob: np.ndarray | None = None, loaded_from: str = "compiled"):
        check_pool(compiled, kv_layout)
        self.compiled, self.buckets, self.kv_layout, self.options = compiled, buckets, kv_layout, options
        self._blob = blob                          # the imported blob's mapping, kept with the model
        self.loaded_from = loaded_from
        self.block_size = kv_layout.block_size
        self.kv_cache = {"element_type": POOL_DTYPES[kv_layout.dtype], "layout": GATHER_LAYOUT,
                         "bytes_per_block": kv_layout.bytes_per_block}
        self.request = compiled.create_infer_request()
        self.pool: KvPool | None = None

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks if self.pool is not None else 0

    def io_spec(self) -> dict[str, list]:
        return {p.get_any_name(): [str(d) for d in p.get_partial_shape()]
                for p in [*self.compiled.inputs, *self.compiled.outputs]}

    def allocate_kv(self, num_blocks: int) -> None:
        if self.pool is not None:
            raise RuntimeError("allocate_kv() is called once; the KV cache is already allocated")
        self.pool = KvPool(self.kv_layout, num_blocks)
        for name, view in self.pool.feeds.items():
            # NOTE: each layer's pool is a contiguous slice of one array: bound once, zero-copy.
            self.request.set_tensor(name, ov.Tensor(view, shared_memory=True))

    def execute(self, batch: PagedBatch) -> EngineResult:
        if self.pool is None:
            raise RuntimeError("allocate_kv(num_blocks) must run before execute()")
        _check_blocks(batch, self.pool.num_blocks, self.block_size)
        calls = plan_calls(batch, self.buckets, self.block_size)
        return assemble_logits(batch, calls, lambda i: self._run(calls[i]))

    def _run(self, call: OrtCall) -> np.ndarray:
        # NOTE: share_outputs: views of the plugin's outputs (no copy of every layer's new K/V and
        # the logits); both are copied out below, before the next call overwrites them.
        self.request.infer(call.feeds, share_inputs=True, share_outputs=True)
        logits = self.request.get_tensor("logits").data
        self.pool.write(self.request.get_tensor("new_kv").data, call.rows, call.cols, call.slots)
        return logits[call.logit_rows[:, 0], call.logit_rows[:, 1]]


def _check_blocks(batch: PagedBatch, num_blocks: int, block_size: int) -> None:
    """Before any call runs: OpenVINO's Gather reads an out-of-range block id as zeros, silently,
    and a slot outside the pool would fail the scatter after the engine ran."""
    ids = np.concatenate([np.asarray(t, np.int64) for t in batch.block_tables]) if batch.block_tables else np.zeros(0)
    slots = np.asarray(batch.slot_mapping)
    if (ids.size and (ids.min() < 0 or ids.max() >= num_blocks)) or \
            (slots.size and (slots.min() < 0 or slots.max() >= num_blocks * block_size)):
        raise ValueError(f"a block id is out of range [0, {num_blocks})")
