"""The engine factory: the manifest's backend field picks the implementation.

Every consumer (engine core, evaluator, server, Triton) loads engines through load_engine and
never names a concrete engine class; `kiln build --backend NAME` picks the builder from the same
registry. Backends import lazily, so an artifact for one backend never loads another's library.
"""

from __future__ import annotations

from typing import Callable

from kiln.artifact import ArtifactError, EngineArtifact
from kiln.engines.base import Engine

EngineLoader = Callable[[EngineArtifact, dict, "int | None"], Engine]
DEFAULT_BACKEND = "ort"


def _load_ort(artifact: EngineArtifact, record: dict, threads: int | None) -> Engine:
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidGraph, InvalidProtobuf, NoSuchFile

    from kiln.engines.ort_engine import KvDtypeMismatch, OrtEngine

    m = artifact.manifest
    # NOTE: a second ort record is the prefill engine (engines per bucket range: build.py)
    prefill = next(((e["serves"]["min_tokens"], artifact.path / e["file"]) for e in m.engines[1:]
                    if e["backend"] == "ort" and "min_tokens" in e.get("serves", {})), None)
    try:
        return OrtEngine(artifact.path / record["file"], m.buckets, m.kv_layout, threads, prefill)
    except KvDtypeMismatch as e:
        raise ArtifactError(f"{artifact.path}: {e}; rebuild it with `kiln build`") from None
    except (Fail, InvalidGraph, InvalidProtobuf, NoSuchFile) as e:
        # e.g. model.onnx.data (the record's "weights", checked with the manifest) gone since
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ArtifactError(f"{artifact.path}: ONNX Runtime cannot load {record['file']} ({first}); "
                            "rebuild it with `kiln build`") from None


def _load_openvino(artifact: EngineArtifact, record: dict, threads: int | None) -> Engine:
    from kiln.engines.openvino.loader import load_openvino_engine

    return load_openvino_engine(artifact, record, threads)


def _load_tensorrt(artifact: EngineArtifact, record: dict, threads: int | None) -> Engine:
    from kiln.engines.tensorrt.loader import load_tensorrt_engine

    return load_tensorrt_engine(artifact, record, threads)


def _load_ort_cuda(artifact: EngineArtifact, record: dict, threads: int | None) -> Engine:
    from kiln.engines.ort_cuda.loader import load_ort_cuda_engine

    return load_ort_cuda_engine(artifact, record, threads)


BACKENDS: dict[str, EngineLoader] = {
    "ort": _load_ort,
    "openvino": _load_openvino,
    "tensorrt": _load_tensorrt,
    "ort-cuda": _load_ort_cuda,
}


def backend_of(artifact: EngineArtifact) -> str:
    return artifact.manifest.engines[0]["backend"]


def load_engine(artifact: EngineArtifact, threads: int | None = None) -> Engine:
    record = artifact.manifest.engines[0]
    loader = BACKENDS.get(record["backend"])
    if loader is None:
        raise ArtifactError(f"{artifact.path} needs the {record['backend']!r} engine backend, which this "
                            f"kiln does not have (it has {', '.join(sorted(BACKENDS))}); rebuild with "
                            f"`kiln build --backend {DEFAULT_BACKEND}` or upgrade kiln")
    return loader(artifact, record, threads)
