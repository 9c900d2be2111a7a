"""Load an artifact's TensorRT engine: GPU, TensorRT release and device checks, then deserialize."""

from __future__ import annotations

from kiln.contract.artifact import ArtifactError, EngineArtifact
from kiln.engines.gpu.compat import check_tensorrt_record
from kiln.engines.gpu.device import NoGpuError, cuda_device_count

REBUILD = "build it for this machine with `kiln build --backend tensorrt`, or use an ort artifact on a CPU"


def load_tensorrt_engine(artifact: EngineArtifact, record: dict, threads: int | None):
    if cuda_device_count() == 0:
        raise ArtifactError(f"{artifact.path} holds a TensorRT engine, which needs a CUDA GPU; this machine "
                            f"has none; {REBUILD}")
    try:
        from kiln.engines.gpu.device import CudaMemory
        from kiln.engines.tensorrt.library import import_tensorrt

        trt = import_tensorrt()
        device = CudaMemory()
    except (NoGpuError, RuntimeError) as e:
        raise ArtifactError(f"{artifact.path}: {e}") from None
    check_tensorrt_record(artifact.path, record, trt.__version__, device.info)
    from kiln.engines.tensorrt.engine import TrtEngine

    m = artifact.manifest
    plan = (artifact.path / record["file"]).read_bytes()
    return TrtEngine.from_plan(plan, record, m.buckets, m.kv_layout, device, m.spec.vocab_size)
