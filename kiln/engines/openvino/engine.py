"""OpenVinoEngine: one packed infer per step over OpenVINO's CPU paged-attention operation.

The engine owns the KV cache: allocate_kv() creates one key and one value tensor per layer, in the
element type and block shape the compiled model asks for, and binds them to the infer request
once. Each step binds only the small per-step inputs; the operation writes the new tokens' K/V
into their blocks itself, and only the rows in logits_indices reach the LM head.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import openvino as ov

from kiln.contract.engine import BucketGrid, EngineResult, KvLayout, PagedBatch
from kiln.engines.openvino.decode_models import DecodeModels, fixed_decode_shapes
from kiln.engines.openvino.feeds import paged_feeds
from kiln.engines.openvino.options import KV_DTYPES, OpenVinoOptions
from kiln.engines.openvino import kiln_attention
from kiln.engines.openvino.paged_graph import paged_attention_extension, paged_model
from kiln.contract.model_spec import ModelSpec


PAGED_LAYOUT = "openvino-paged"     # the engine record's "layout": OpenVINO's PagedAttentionExtension
GATHER_LAYOUT = "paged-gather"      # kiln's paged gather in the graph (gathered.py)


def core_for(options: OpenVinoOptions) -> ov.Core:
    """A Core that can read what these options built: with kiln's op library where the linears are kiln's."""
    core = ov.Core()
    if options.needs_kiln_library:
        from kiln.engines.openvino import native

        core.add_extension(str(native.require()))
    return core


def compile_paged(xml: Path, spec: ModelSpec, options: OpenVinoOptions, threads: int,
                  decodes: int | None = None) -> ov.CompiledModel:
    """Read the standard IR, rewrite it to the paged model, compile it for this CPU; decodes: a copy
    for steps of that many decodes (decode_models.py)."""
    core = core_for(options)
    model = paged_model(core.read_model(xml), spec, options.attention)
    if options.attention:
        model = kiln_attention.with_library_operations(core, model)
    if decodes is not None:
        model.reshape(fixed_decode_shapes(decodes))
    return core.compile_model(model, "CPU", options.compile_properties(threads))


def import_paged(blob: Path, spec: ModelSpec, options: OpenVinoOptions,
                 threads: int) -> tuple[ov.CompiledModel, np.ndarray]:
    """The build's compiled paged model, without the rewrite or the plugin's transformations; and
    the blob's mapping, which must live as long as the model (the plugin may keep pointing into it).

    Raises RuntimeError when the plugin refuses the blob: it checks the OpenVINO release and the CPU
    instruction set the blob was compiled for, and refuses any other (or a damaged header)."""
    core = core_for(options)
    core.add_extension(paged_attention_extension(spec))
    return _import_blob(core, blob, options, threads)


def compile_gathered(xml: Path, options: OpenVinoOptions, threads: int) -> ov.CompiledModel:
    """The kv_io graph as it is (its attention reads kiln's pool through the block tables)."""
    core = ov.Core()
    return core.compile_model(core.read_model(xml), "CPU", options.compile_properties(threads))


def import_gathered(blob: Path, options: OpenVinoOptions, threads: int) -> tuple[ov.CompiledModel, np.ndarray]:
    """As import_paged, for a graph with no OpenVINO extension operation in it."""
    return _import_blob(ov.Core(), blob, options, threads)


def _import_blob(core: ov.Core, blob: Path, options: OpenVinoOptions,
                 threads: int) -> tuple[ov.CompiledModel, np.ndarray]:
    # NOTE: a private (copy-on-write) mapping: no copy of the file, its pages shared with the page cache.
    mapped = np.memmap(blob, dtype=np.uint8, mode="c")
    compiled = core.import_model(ov.Tensor(mapped, shared_memory=True), "CPU", options.compile_properties(threads))
    return compiled, mapped


class KvCacheMismatch(RuntimeError):
    """The compiled model wants a cache other than the one the artifact recorded."""


def cache_inputs(compiled: ov.CompiledModel) -> list[ov.ConstOutput]:
    return [i for i in compiled.inputs if i.get_any_name().startswith(("key_cache.", "value_cache."))]


def describe_kv_cache(compiled: ov.CompiledModel) -> dict:
    """The cache the plugin allocates per block: element type, key and value block shapes, bytes."""
    caches = {i.get_any_name(): i for i in cache_inputs(compiled)}
    key, value = caches["key_cache.0"], caches["value_cache.0"]
    key_shape, value_shape = _block_shape(key), _block_shape(value)
    per_layer = sum(int(np.prod(s)) * port.get_element_type().size
                    for s, port in ((key_shape, key), (value_shape, value)))
    return {"element_type": key.get_element_type().get_type_name(), "key_block_shape": key_shape,
            "value_block_shape": value_shape, "bytes_per_block": per_layer * (len(caches) // 2)}


def _block_shape(port: ov.ConstOutput) -> list[int]:
    """[kv_heads, rows, cols] of one block: the compiled cache shape less its dynamic block count."""
    return [d.get_length() for d in port.get_partial_shape()[1:]]


class OpenVinoEngine:
    def __init__(self, compiled: ov.CompiledModel, buckets: BucketGrid, kv_layout: KvLayout,
                 options: OpenVinoOptions, expected_kv: dict | None = None, blob: np.ndarray | None = None,
                 loaded_from: str = "compiled", compile_decodes: Callable[[int], ov.CompiledModel] | None = None,
                 decode_copies: int = 0):
        """compile_decodes(b): the model compiled for steps of b decodes, for decode_copies of them at
        most (decode_models.py); None or 0: every step runs on `compiled`."""
        self.compiled, self.buckets, self.options = compiled, buckets, options
        self._blob = blob                          # the imported blob's mapping, kept with the model
        self.loaded_from = loaded_from             # "blob" (imported) | "compiled" (rewrite + compile)
        self.kv_cache = describe_kv_cache(compiled)
        if expected_kv is not None and self.kv_cache != expected_kv:
            raise KvCacheMismatch(f"the OpenVINO CPU plugin here allocates the KV cache as {self.kv_cache}, "
                                  f"but the artifact was built for {expected_kv}")
        if kv_layout.bytes_per_block != self.kv_cache["bytes_per_block"]:
            raise KvCacheMismatch(f"the manifest's KV layout counts {kv_layout.bytes_per_block} bytes per block, "
                                  f"the plugin allocates {self.kv_cache['bytes_per_block']}")
        self.kv_layout = kv_layout
        self.block_size = kv_layout.block_size
        self.request = compiled.create_infer_request()
        self.num_blocks = 0
        self._caches: list[ov.Tensor] = []
        self._storage: list[np.ndarray] = []       # owns the memory the shared tensors view
        self.decode_models = (DecodeModels(compile_decodes, self._bind_caches, decode_copies)
                              if compile_decodes is not None and decode_copies > 0 else None)

    def io_spec(self) -> dict[str, list]:
        return {p.get_any_name(): [str(d) for d in p.get_partial_shape()]
                for p in [*self.compiled.inputs, *self.compiled.outputs]}

    def allocate_kv(self, num_blocks: int) -> None:
        if self._caches:
            raise RuntimeError("allocate_kv() is called once; the KV cache is already allocated")
        for port in cache_inputs(self.compiled):
            shape = [num_blocks, *_block_shape(port)]
            # NOTE: numpy's zeros come from calloc: zero pages the OS maps only when first written,
            # so a large budget costs memory as it fills, and no slot ever holds garbage (a NaN in
            # the unused tail of a block would survive masking).
            storage = np.zeros(shape, KV_DTYPES[port.get_element_type().get_type_name()])
            self._caches.append(ov.Tensor(storage, shared_memory=True))
            self._storage.append(storage)
        self._bind_caches(self.request)
        self.num_blocks = num_blocks

    def _bind_caches(self, request: ov.InferRequest) -> None:
        """Every compiled copy's request reads and writes the one cache."""
        for port, tensor in zip(cache_inputs(self.compiled), self._caches):
            request.set_tensor(port.get_any_name(), tensor)

    def execute(self, batch: PagedBatch) -> EngineResult:
        if not self._caches:
            raise RuntimeError("allocate_kv(num_blocks) must run before execute()")
        # NOTE: share_outputs: infer() would otherwise copy every output into a fresh array (the
        # logits of 32 decodes are 6 MB), only for the copy below to be made again; that one stays,
        # since the next call overwrites the plugin's output tensor.
        request = self._request_for(batch)
        request.infer(paged_feeds(batch, self.block_size, self.num_blocks), share_inputs=True, share_outputs=True)
        logits = request.get_output_tensor(0).data
        return EngineResult(np.array(logits, np.float32, copy=True))

    def _request_for(self, batch: PagedBatch) -> ov.InferRequest:
        """A step of decodes only (one token and one row of logits per sequence) on the copy compiled
        for its size, where there is one; any other step on the dynamic model."""
        b = batch.num_seqs
        if self.decode_models is not None and batch.num_tokens == b == len(batch.logits_indices):
            return self.decode_models.request_for(b) or self.request
        return self.request
