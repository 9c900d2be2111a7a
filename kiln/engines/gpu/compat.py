"""The GPU engine record's toolchain and device fields, and the refusals when they differ.

A TensorRT engine is specific to the TensorRT release and, by default, to the GPU model that built
it (its kernels were chosen by timing on that device); loading it elsewhere either fails deep in
deserialization or runs untuned. kiln records both and refuses up front, saying what to do.

An ort-cuda graph is checked against the contrib-op schemas (PagedAttention's among them) of the
onnxruntime that built it; those change between minor releases, so another minor release is
refused the same way (a patch release loads).
"""

from __future__ import annotations

from pathlib import Path

from kiln.contract.artifact import ArtifactError
from kiln.engines.gpu.device import DeviceInfo


def release(version: str, parts: int = 3) -> str:
    """'10.8.0.43' -> '10.8.0': TensorRT engines follow major.minor.patch."""
    return ".".join(version.split("+")[0].split(".")[:parts])


def check_tensorrt_record(root: Path, record: dict, tensorrt_version: str, device: DeviceInfo) -> None:
    rebuild = "rebuild it on this machine with `kiln build --backend tensorrt`"
    for key in ("tensorrt", "device", "profiles", "precision"):
        if key not in record:
            raise ArtifactError(f"{root}: the tensorrt engine record has no {key!r}; {rebuild}")
    built = record["tensorrt"]
    if release(built) != release(tensorrt_version):
        raise ArtifactError(f"{root} holds a TensorRT {built} engine, but this machine has TensorRT "
                            f"{tensorrt_version}; install tensorrt=={built} or {rebuild}")
    want = DeviceInfo(**{k: record["device"][k] for k in ("name", "compute_capability")})
    if want.compute_capability != device.compute_capability:
        raise ArtifactError(f"{root} holds an engine built for {want.name} (compute capability "
                            f"{want.compute_capability}); this GPU is {device.name} (compute capability "
                            f"{device.compute_capability}); {rebuild}")
    if want.name != device.name:
        raise ArtifactError(f"{root} holds an engine tuned on {want.name}; this GPU is {device.name} "
                            f"(same compute capability, but TensorRT engines are specific to the GPU "
                            f"model that built them); {rebuild}")


ORT_CUDA_REBUILD = "or rebuild the artifact here with `kiln build --backend ort-cuda`"


def check_onnxruntime_record(root: Path, record: dict, onnxruntime_version: str) -> None:
    built = record.get("onnxruntime")
    if not built:
        raise ArtifactError(f"{root}: the ort-cuda engine record records no onnxruntime release; "
                            f"{ORT_CUDA_REBUILD.removeprefix('or ')}")
    if release(built, 2) != release(onnxruntime_version, 2):
        raise ArtifactError(f"{root} was built with onnxruntime {built}; this machine has onnxruntime "
                            f"{onnxruntime_version}, another minor release, whose contrib ops may differ; "
                            f"install onnxruntime-gpu=={release(built, 2)}.* with its CUDA libraries (the GPU "
                            f"guide's install section) {ORT_CUDA_REBUILD}")
