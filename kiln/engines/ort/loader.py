"""Load an artifact's ONNX Runtime engine (and its prefill engine, when the build made one)."""

from __future__ import annotations

from kiln.contract.artifact import ArtifactError, EngineArtifact
from kiln.contract.engine import Engine


def load_ort_engine(artifact: EngineArtifact, record: dict, threads: int | None) -> Engine:
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidGraph, InvalidProtobuf, NoSuchFile

    from kiln.engines.ort.engine import KvDtypeMismatch, OrtEngine

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
