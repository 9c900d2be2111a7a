"""Load an artifact's OpenVINO engine: verify its files and toolchain, compile once, check the cache."""

from __future__ import annotations

from pathlib import Path

import openvino as ov

from kiln.contract.artifact import ArtifactError, EngineArtifact
from kiln.contract.engine import BucketGrid, KvLayout, default_threads
from kiln.engines.openvino.engine import KvCacheMismatch, OpenVinoEngine, compile_paged
from kiln.engines.openvino.options import OpenVinoOptions
from kiln.contract.model_spec import ModelSpec

REBUILD = "rebuild it with `kiln build --backend openvino`"


def load_openvino_engine(artifact: EngineArtifact, record: dict, threads: int | None) -> OpenVinoEngine:
    m = artifact.manifest
    return open_openvino(artifact.path, record, m.spec, m.buckets, m.kv_layout, threads)


def open_openvino(root: Path, record: dict, spec: ModelSpec, buckets: BucketGrid, kv_layout: KvLayout,
                  threads: int | None = None) -> OpenVinoEngine:
    _check_record(root, record, kv_layout)
    options = OpenVinoOptions.from_dict(record["options"])
    try:
        compiled = compile_paged(root / record["file"], spec, options, threads or default_threads())
    except (RuntimeError, ValueError) as e:
        raise ArtifactError(f"{root}: OpenVINO cannot read or compile {record['file']} ({_first_line(e)}); "
                            f"{REBUILD}") from None
    try:
        return OpenVinoEngine(compiled, buckets, kv_layout, options, expected_kv=record["kv_cache"])
    except KvCacheMismatch as e:
        raise ArtifactError(f"{root}: {e}; {REBUILD} on this machine") from None


def _check_record(root: Path, record: dict, kv_layout: KvLayout) -> None:
    built = record.get("openvino", "?")
    if _release(built) != _release(ov.get_version()):
        raise ArtifactError(f"{root} was built with OpenVINO {built}, but this runtime has "
                            f"{ov.get_version()}; install that openvino release or {REBUILD}")
    for key in ("options", "kv_cache", "weights"):
        if key not in record:
            raise ArtifactError(f"{root}: the openvino engine record has no {key!r}; {REBUILD}")
    if KvLayout(**record["kv_layout"]) != kv_layout:
        raise ArtifactError(f"{root}: the manifest's KV layout {kv_layout} is not the one the openvino "
                            f"engine was compiled for ({record['kv_layout']}); {REBUILD}")
    # NOTE: model.bin's size and sha256 are checked with every other file an engine record names
    # (artifact_checks), once, when the artifact loads.


def _release(version: str) -> str:
    # "2026.4.1-20480-abc" -> "2026.4": the IR and the plugin's cache layout follow the release.
    return ".".join(version.split("-")[0].split(".")[:2])


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
