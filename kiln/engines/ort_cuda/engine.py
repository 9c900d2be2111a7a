"""OrtCudaEngine: one packed ONNX Runtime run per step on the CUDA provider.

allocate_kv() creates each layer's key and value cache as an OrtValue in GPU memory and binds it
once, as the op's cache input and as its aliased output (the op writes new K/V in place, as
GroupQueryAttention's shared past/present buffer does), so the pool never leaves the device. Each
step binds only the small inputs (copied host -> device by the binding) and the logits output.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from kiln.contract.engine import BucketGrid, EngineResult, KvLayout, PagedBatch
from kiln.engines.ort_cuda.feeds import cuda_feeds

CUDA = "CUDAExecutionProvider"
# OrtValue element types: numpy's for fp16; ONNX's enum for bf16, which numpy lacks (TensorProto.BFLOAT16).
ELEMENT_TYPES = {"float16": np.float16, "bfloat16": 16}



def cache_name(kind: str, layer: int, out: bool = False) -> str:
    """The graph's name for layer `layer`'s key or value cache (the paged graph's input; out: its output)."""
    return f"{kind}_cache{'_out' if out else ''}.{layer}"


class CudaProviderMissing(RuntimeError):
    """ONNX Runtime here cannot run on the GPU; the message says what to install."""


def cuda_session(model_path: Path, device_id: int = 0) -> ort.InferenceSession:
    if CUDA not in ort.get_available_providers():
        raise CudaProviderMissing(f"onnxruntime {ort.__version__} here is a CPU build; install "
                                  "onnxruntime-gpu with its CUDA libraries (the GPU guide says how)")
    preload_cuda_libraries()
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    session = ort.InferenceSession(str(model_path), opts, providers=[(CUDA, {"device_id": device_id})])
    # NOTE: ONNX Runtime falls back to CPU silently when the CUDA libraries fail to load.
    if CUDA not in session.get_providers():
        raise CudaProviderMissing("onnxruntime-gpu could not start its CUDA provider (CUDA or cuDNN "
                                  "libraries missing or of another major version; install "
                                  "onnxruntime-gpu[cuda,cudnn] or put CUDA and cuDNN on the library path; "
                                  "see its log above)")
    return session


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


class OrtCudaEngine:
    def __init__(self, session: ort.InferenceSession, buckets: BucketGrid, kv_layout: KvLayout, device_id: int = 0):
        self.session, self.buckets, self.kv_layout, self.device_id = session, buckets, kv_layout, device_id
        self.binding = session.io_binding()
        self.num_blocks = 0
        self._caches: list[ort.OrtValue] = []

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
                cache = ort.OrtValue.ortvalue_from_shape_and_type(shape, ELEMENT_TYPES[kv.dtype], "cuda", self.device_id)
                self.binding.bind_ortvalue_input(cache_name(kind, i), cache)
                self.binding.bind_ortvalue_output(cache_name(kind, i, out=True), cache)
                self._caches.append(cache)
        self.num_blocks = num_blocks

    def execute(self, batch: PagedBatch) -> EngineResult:
        if not self._caches:
            raise RuntimeError("allocate_kv(num_blocks) must be called before execute()")
        for name, array in cuda_feeds(batch, self.kv_layout.block_size, self.num_blocks).items():
            self.binding.bind_cpu_input(name, array)
        self.binding.bind_output("logits", "cpu")
        self.session.run_with_iobinding(self.binding)
        # NOTE: outputs come back in binding order: the caches (bound first, once), then logits.
        logits = self.binding.get_outputs()[len(self._caches)].numpy()
        return EngineResult(np.asarray(logits, np.float32))
