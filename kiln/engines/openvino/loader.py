"""Load an artifact's OpenVINO engine: verify its files and toolchain, import (or compile), check the cache.

The build saves the compiled paged model (engines/openvino/compiled.blob, recorded under the engine
record's "compiled" with its sha256): importing it skips the paged rewrite and the CPU plugin's
transformations, most of a cold start. The plugin refuses a blob compiled by another OpenVINO
release or for another CPU instruction set; the loader then rewrites and compiles the IR, as an
artifact without a blob always does, and says so once.
"""

from __future__ import annotations

import logging
from pathlib import Path

import openvino as ov

from kiln.contract.artifact import ArtifactError, EngineArtifact
from kiln.contract.engine import BucketGrid, KvLayout, default_threads
from kiln.engines.openvino.decode_models import copies_allowed
from kiln.engines.openvino.engine import (GATHER_LAYOUT, KvCacheMismatch, OpenVinoEngine, compile_gathered,
                                          compile_paged, import_gathered, import_paged)
from kiln.engines.openvino.gathered import OpenVinoGatherEngine, PoolMismatch
from kiln.engines.openvino.options import OpenVinoOptions
from kiln.contract.model_spec import ModelSpec

log = logging.getLogger("kiln")

REBUILD = "rebuild it with `kiln build --backend openvino`"


def load_openvino_engine(artifact: EngineArtifact, record: dict,
                         threads: int | None) -> OpenVinoEngine | OpenVinoGatherEngine:
    m = artifact.manifest
    return open_openvino(artifact.path, record, m.spec, m.buckets, m.kv_layout, threads)


def open_openvino(root: Path, record: dict, spec: ModelSpec, buckets: BucketGrid, kv_layout: KvLayout,
                  threads: int | None = None, use_blob: bool = True) -> OpenVinoEngine | OpenVinoGatherEngine:
    """use_blob=False: always rewrite and compile the IR (what a load falls back to)."""
    _check_record(root, record, kv_layout)
    options = OpenVinoOptions.from_dict(record["options"]).on_this_cpu()
    threads = threads or default_threads()
    gather = record.get("layout") == GATHER_LAYOUT
    imported = _import(root, record, spec, options, threads, gather) if use_blob else None
    compiled, blob = imported or (None, None)
    if compiled is None:
        try:
            compiled = (compile_gathered(root / record["file"], options, threads) if gather
                        else compile_paged(root / record["file"], spec, options, threads))
        except (RuntimeError, ValueError) as e:
            raise ArtifactError(f"{root}: OpenVINO cannot read or compile {record['file']} ({_first_line(e)}); "
                                f"{REBUILD}") from None
    loaded_from = "blob" if blob is not None else "compiled"
    try:
        if gather:
            return OpenVinoGatherEngine(compiled, buckets, kv_layout, options, blob=blob, loaded_from=loaded_from)
        return OpenVinoEngine(compiled, buckets, kv_layout, options, expected_kv=record["kv_cache"], blob=blob,
                              loaded_from=loaded_from, decode_copies=copies_allowed(),
                              compile_decodes=lambda b: compile_paged(root / record["file"], spec, options, threads, b))
    except (KvCacheMismatch, PoolMismatch) as e:
        raise ArtifactError(f"{root}: {e}; {REBUILD} on this machine") from None


def _import(root: Path, record: dict, spec: ModelSpec, options: OpenVinoOptions, threads: int, gather: bool):
    """(compiled model, blob mapping) from the build's blob, or None (logged) when the plugin refuses it."""
    blob = record.get("compiled")
    if not blob:
        return None
    try:
        if gather:
            return import_gathered(root / blob["file"], options, threads)
        return import_paged(root / blob["file"], spec, options, threads)
    except (RuntimeError, ValueError, OSError) as e:
        log.warning("%s: OpenVINO %s on this CPU does not take the compiled blob built with OpenVINO %s on %s (%s); "
                    "compiling the IR instead, which makes every start slower: %s on this machine to start fast",
                    root, ov.get_version().split("-")[0], blob.get("openvino", "?").split("-")[0],
                    blob.get("device", "?"), _reason(e), REBUILD.replace("rebuild it", "rebuild the artifact"))
        return None


def _check_record(root: Path, record: dict, kv_layout: KvLayout) -> None:
    built = record.get("openvino", "?")
    if _release(built) != _release(ov.get_version()):
        raise ArtifactError(f"{root} was built with OpenVINO {built}, but this runtime has "
                            f"{ov.get_version()}; install that openvino release or {REBUILD}")
    for key in ("options", "kv_cache", "weights"):
        if key not in record:
            raise ArtifactError(f"{root}: the openvino engine record has no {key!r}; {REBUILD}")
    if record["options"].get("kernels"):
        _check_kiln_kernels(root)
    if KvLayout(**record["kv_layout"]) != kv_layout:
        raise ArtifactError(f"{root}: the manifest's KV layout {kv_layout} is not the one the openvino "
                            f"engine was compiled for ({record['kv_layout']}); {REBUILD}")
    # NOTE: model.bin's and compiled.blob's sizes and sha256 are checked with every other file an
    # engine record names (artifact_checks), once, when the artifact loads.


def _check_kiln_kernels(root: Path) -> None:
    """An engine on kiln's int8 linears needs the op library and a CPU that runs its kernel."""
    from kiln.engines.openvino import native

    if not native.available():
        raise ArtifactError(f"{root}: its linears are kiln's own OpenVINO operations and the op library is not "
                            f"built here: run `{native.build_command()}` (needs g++), or {REBUILD} --quant int8 "
                            f"on a machine without it")
    missing = [f for f in native.REQUIRED_FLAGS if f not in native.cpu_flags()]
    if missing:
        raise ArtifactError(f"{root}: its linears are kiln's int8 kernels for AVX-512 VNNI, which this CPU lacks "
                            f"({', '.join(missing)}); {REBUILD} on this machine")


def _release(version: str) -> str:
    # "2026.4.1-20480-abc" -> "2026.4": the IR and the plugin's cache layout follow the release.
    return ".".join(version.split("-")[0].split(".")[:2])


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _reason(e: Exception) -> str:
    """The plugin's own words: OpenVINO's message opens with lines of source locations."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    said = [ln for ln in lines if not ln.startswith(("Exception from", "Check '"))]
    return " ".join(said)[:400] if said else _first_line(e)
