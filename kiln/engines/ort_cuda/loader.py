"""Load an artifact's ort-cuda engine: the onnxruntime release it was built with, a GPU, ONNX
Runtime's CUDA provider, then the session."""

from __future__ import annotations

import onnxruntime as ort

from kiln.contract.artifact import ArtifactError, EngineArtifact
from kiln.engines.gpu.compat import check_onnxruntime_record
from kiln.engines.gpu.device import cuda_device_count

WHAT_TO_DO = "run it on a machine with an NVIDIA GPU and onnxruntime-gpu, or build an ort artifact for CPUs"


def load_ort_cuda_engine(artifact: EngineArtifact, record: dict, threads: int | None):
    # First: a release mismatch is the artifact's answer on any machine, with or without a GPU.
    check_onnxruntime_record(artifact.path, record, ort.__version__)
    if cuda_device_count() == 0:
        raise ArtifactError(f"{artifact.path} holds an ort-cuda engine, which needs a CUDA GPU; this machine "
                            f"has none; {WHAT_TO_DO}")
    from kiln.engines.ort_cuda.engine import CudaProviderMissing, OrtCudaEngine, cuda_session

    try:
        session = cuda_session(artifact.path / record["file"])
    except CudaProviderMissing as e:
        raise ArtifactError(f"{artifact.path}: {e}") from None
    m = artifact.manifest
    return OrtCudaEngine(session, m.buckets, m.kv_layout)
