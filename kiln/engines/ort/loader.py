"""Load an artifact's ONNX Runtime engine (and its prefill engine, when the build made one)."""

from __future__ import annotations

from kiln.contract.artifact import ArtifactError, EngineArtifact
from kiln.contract.engine import Engine


def load_ort_engine(artifact: EngineArtifact, record: dict, threads: int | None) -> Engine:
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidGraph, InvalidProtobuf, NoSuchFile

    from kiln.engines.ort.engine import KvDtypeMismatch, OrtEngine

    m = artifact.manifest
    _require_native_ops(artifact)
    _require_vnni(artifact)
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


def _require_native_ops(artifact: EngineArtifact) -> None:
    """An engine built with kiln's custom ops (kiln.MatMulQ4Min) needs the op library on this machine."""
    from kiln.engines.ort import native

    needed = sorted({op for e in artifact.manifest.engines if e["backend"] == "ort" for op in e.get("native_ops", ())})
    if needed and not native.available():
        raise ArtifactError(f"{artifact.path}: its ONNX Runtime engine runs {', '.join(needed)} from kiln's op library, "
                            f"which is not built here: run `{native.build_command()}` (it needs a C++ compiler, g++), or "
                            "rebuild the artifact with `kiln build` on this machine")


def _require_vnni(artifact: EngineArtifact) -> None:
    """Full-range int8 weights against uint8 activations (a w8a8 engine built on a CPU with VNNI)
    saturate the integer GEMM of a CPU without it, and the answers turn to noise (int8_dot.py)."""
    from kiln.engines.ort.int8_dot import u8s8_saturates

    if any("vnni" in e.get("requires_cpu", ()) for e in artifact.manifest.engines) and u8s8_saturates():
        raise ArtifactError(f"{artifact.path}: its w8a8 linears take full-range int8 weights, which this CPU "
                            "(no VNNI) sums in saturating 16-bit lanes, so its answers would be wrong; rebuild "
                            "the artifact with `kiln build` on this machine (it keeps the weights within 7 bits "
                            "here), or build without w8a8 (--quant int8)")
