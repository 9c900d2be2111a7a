"""OrtCudaEngine: one packed ONNX Runtime run per step on the CUDA provider.

allocate_kv() creates each layer's key and value cache as an OrtValue in GPU memory and binds it
once, as the op's cache input and as its aliased output (the op writes new K/V in place, as
GroupQueryAttention's shared past/present buffer does), so the pool never leaves the device. Each
step binds only the small inputs (copied host -> device by the binding) and the logits output.

A pure decode step (one new token and one logits row per sequence) runs as a CUDA graph
(gpu/graphs.py) when the session has them (cuda_session): ONNX Runtime captures and replays its
graphs itself, one per gpu_graph_id, and needs every input and output at one device address. So
each key (sequences, block-table width padded up to a power of two with -1) gets its own binding
over device OrtValues made once, whose contents each step overwrites; its first run warms up and
captures, later runs replay. Other steps run eagerly (graph id -1).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from kiln.contract.engine import BucketGrid, EngineResult, KvLayout, PagedBatch
from kiln.engines.gpu.graphs import CaptureFailed, DecodeGraphs, pad_columns, padded_width
from kiln.engines.ort_cuda.feeds import cuda_feeds

log = logging.getLogger("kiln.engines.gpu")

CUDA = "CUDAExecutionProvider"
# OrtValue element types: numpy's for fp16; ONNX's enum for bf16, which numpy lacks (TensorProto.BFLOAT16).
ELEMENT_TYPES = {"float16": np.float16, "bfloat16": 16, "float32": np.float32}
GRAPH_ID = "gpu_graph_id"           # ONNX Runtime's run option naming the graph a run captures or replays
NO_GRAPH = "-1"                     # ... and the id that runs without one


def cache_name(kind: str, layer: int, out: bool = False) -> str:
    """The graph's name for layer `layer`'s key or value cache (the paged graph's input; out: its output)."""
    return f"{kind}_cache{'_out' if out else ''}.{layer}"


class CudaProviderMissing(RuntimeError):
    """ONNX Runtime here cannot run on the GPU; the message says what to install."""


def cuda_session(model_path: Path, device_id: int = 0, cuda_graphs: bool = True) -> ort.InferenceSession:
    """A session on the CUDA provider, with CUDA graphs where ONNX Runtime accepts them for this
    graph (it refuses a graph with nodes on the CPU; the session is then made without, and says so)."""
    if CUDA not in ort.get_available_providers():
        raise CudaProviderMissing(f"onnxruntime {ort.__version__} here is a CPU build; install "
                                  "onnxruntime-gpu with its CUDA libraries (the GPU guide says how)")
    preload_cuda_libraries()
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    options = {"device_id": device_id}
    try:
        session = ort.InferenceSession(str(model_path), opts, providers=[(CUDA, options | graph_options(cuda_graphs))])
    except Exception as e:          # onnxruntime raises its own exception types per status code
        if not cuda_graphs:
            raise
        log.warning("ort-cuda engine: no CUDA graphs for this graph (%s); every step runs eagerly",
                    str(e).strip().splitlines()[0])
        session = ort.InferenceSession(str(model_path), opts, providers=[(CUDA, options)])
    # NOTE: ONNX Runtime falls back to CPU silently when the CUDA libraries fail to load.
    if CUDA not in session.get_providers():
        raise CudaProviderMissing("onnxruntime-gpu could not start its CUDA provider (CUDA or cuDNN "
                                  "libraries missing or of another major version; install "
                                  "onnxruntime-gpu[cuda,cudnn] or put CUDA and cuDNN on the library path; "
                                  "see its log above)")
    return session


def graph_options(cuda_graphs: bool) -> dict[str, str]:
    return {"enable_cuda_graph": "1"} if cuda_graphs else {}


def has_cuda_graphs(session) -> bool:
    """Whether the session was made with CUDA graphs (the provider options it kept)."""
    return session.get_provider_options().get(CUDA, {}).get("enable_cuda_graph") == "1"


def preload_cuda_libraries() -> None:
    """Load CUDA and cuDNN before the provider needs them. onnxruntime-gpu's [cuda,cudnn] extras
    install them as nvidia pip packages, outside the loader's search path, and only preload_dlls()
    finds them there; with CUDA installed system-wide it finds nothing more to do."""
    preload = getattr(ort, "preload_dlls", None)
    if preload is None:
        return
    try:
        preload(cuda=True, cudnn=True)
    except OSError:
        pass        # cuda_session then finds no CUDA provider and says what to install


@dataclass
class GraphBinding:
    """One graph key's binding: device OrtValues at fixed addresses, and its run options."""
    binding: ort.IOBinding
    inputs: dict[str, ort.OrtValue]
    logits: ort.OrtValue
    run_options: ort.RunOptions


class OrtGraphRuns:
    """GraphDevice over ONNX Runtime's own graphs: a key's first run (graph id set) warms up,
    captures and replays in one call; its later runs replay. A failed first run leaves the call
    undone (the caller then runs it eagerly)."""

    def capture(self, step):
        try:
            step()
        except Exception as e:          # onnxruntime raises its own exception types per status code
            raise CaptureFailed(str(e).strip().splitlines()[0], work_done=False) from None
        return step

    def launch(self, graph) -> None:
        graph()


class OrtCudaEngine:
    def __init__(self, session: ort.InferenceSession, buckets: BucketGrid, kv_layout: KvLayout, device_id: int = 0,
                 device: str = "cuda"):
        self.session, self.buckets, self.kv_layout, self.device_id = session, buckets, kv_layout, device_id
        self.device = device            # where OrtValues live ("cpu" only in the tests' doubles)
        self.binding = session.io_binding()
        self.num_blocks = 0
        self._caches: list[ort.OrtValue] = []
        self.graphs = DecodeGraphs(OrtGraphRuns(), enabled=device != "cuda" or has_cuda_graphs(session),
                                   warmup=0, what="ort-cuda engine")
        self._graph_bindings: dict[tuple, GraphBinding] = {}
        self._eager_options = ort.RunOptions()
        self._eager_options.add_run_config_entry(GRAPH_ID, NO_GRAPH)

    def io_spec(self) -> dict[str, list]:
        return {v.name: list(v.shape) for v in [*self.session.get_inputs(), *self.session.get_outputs()]}

    def allocate_kv(self, num_blocks: int) -> None:
        if self._caches:
            raise RuntimeError("allocate_kv() is called once; the KV cache is already allocated")
        kv = self.kv_layout
        shape = [num_blocks, kv.block_size, kv.num_kv_heads, kv.head_dim]
        # NOTE: not zeroed: the op reads a sequence's keys only up to its own length.
        for i in range(kv.num_layers):
            for kind in ("key", "value"):
                cache = ort.OrtValue.ortvalue_from_shape_and_type(shape, ELEMENT_TYPES[kv.dtype], self.device,
                                                                  self.device_id)
                self._caches.append(cache)
        self._bind_caches(self.binding)
        self.num_blocks = num_blocks

    def _bind_caches(self, binding: ort.IOBinding) -> None:
        names = [(kind, i) for i in range(self.kv_layout.num_layers) for kind in ("key", "value")]
        for (kind, i), cache in zip(names, self._caches):
            binding.bind_ortvalue_input(cache_name(kind, i), cache)
            binding.bind_ortvalue_output(cache_name(kind, i, out=True), cache)

    def execute(self, batch: PagedBatch) -> EngineResult:
        if not self._caches:
            raise RuntimeError("allocate_kv(num_blocks) must be called before execute()")
        feeds = cuda_feeds(batch, self.kv_layout.block_size, self.num_blocks)
        key = self._graph_key(batch, feeds)
        if key is None:
            return EngineResult(self._run_eager(feeds))
        feeds = {**feeds, "block_table": pad_columns(feeds["block_table"], key[1], -1)}
        graph = self._graph_binding(key, feeds)
        for name, array in feeds.items():
            graph.inputs[name].update_inplace(np.ascontiguousarray(array))
        result = {}
        self.graphs.run(key, eager=lambda: result.update(logits=self._run_eager(feeds)),
                        step=lambda: self.session.run_with_iobinding(graph.binding, graph.run_options))
        logits = result.get("logits")
        return EngineResult(np.asarray(graph.logits.numpy() if logits is None else logits, np.float32))

    def _run_eager(self, feeds: dict[str, np.ndarray]) -> np.ndarray:
        for name, array in feeds.items():
            self.binding.bind_cpu_input(name, array)
        self.binding.bind_output("logits", "cpu")
        self.session.run_with_iobinding(self.binding, self._eager_options)
        # NOTE: outputs come back in binding order: the caches (bound first, once), then logits.
        return np.asarray(self.binding.get_outputs()[len(self._caches)].numpy(), np.float32)

    def _graph_key(self, batch: PagedBatch, feeds: dict[str, np.ndarray]) -> tuple | None:
        """(sequences, padded block-table width) for a pure decode step within the grid; else None."""
        n = batch.num_seqs
        decode = (np.asarray(batch.query_lens) == 1).all() and len(batch.logits_indices) == n
        if not (self.graphs.enabled and decode and n <= self.buckets.max_batch):
            return None
        return n, padded_width(feeds["block_table"].shape[1])

    def _graph_binding(self, key: tuple, feeds: dict[str, np.ndarray]) -> GraphBinding:
        """The key's binding, made on its first step: device OrtValues shaped as these feeds."""
        if key in self._graph_bindings:
            return self._graph_bindings[key]
        binding = self.session.io_binding()
        self._bind_caches(binding)
        inputs = {name: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a), self.device, self.device_id)
                  for name, a in feeds.items()}
        for name, value in inputs.items():
            binding.bind_ortvalue_input(name, value)
        vocab = self.session.get_outputs()[0].shape[-1]
        logits = ort.OrtValue.ortvalue_from_shape_and_type([key[0], vocab], np.float32, self.device, self.device_id)
        binding.bind_ortvalue_output("logits", logits)
        options = ort.RunOptions()
        options.add_run_config_entry(GRAPH_ID, str(len(self._graph_bindings) + 1))   # ids from 1; -1 is none
        self._graph_bindings[key] = GraphBinding(binding, inputs, logits, options)
        return self._graph_bindings[key]
