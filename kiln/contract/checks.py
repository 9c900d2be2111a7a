"""Load-time checks of an artifact folder; each refusal says what is wrong and what to do."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from kiln.contract.manifest import MANIFEST, SCHEMA_VERSION, ArtifactError, Manifest, installed_version, sha256_file

REBUILD = "rebuild it with `kiln build`"


def check_artifact(path: Path, verify_checksums: bool = True) -> Manifest:
    """Every check, checksums included, before returning."""
    manifest = check_artifact_shape(path)
    if verify_checksums:
        verify_checksums_of(path, manifest)
    return manifest


def verify_checksums_of(path: Path, manifest: Manifest) -> None:
    """The sha256 of every file the manifest lists (the slow part: the engine may load meanwhile)."""
    for record in _all_files(manifest):
        if sha256_file(path / record["file"]) != record["sha256"]:
            raise ArtifactError(f"{path}: {record['file']} is corrupt (sha256 mismatch); {REBUILD}")


def check_artifact_shape(path: Path) -> Manifest:
    """Everything but the checksums: schema, toolchain, KV layout, and each file present, confined
    and of its recorded size."""
    raw = _read_manifest(path)
    _check_schema(path, raw)
    try:
        manifest = Manifest.from_json(raw)
    except (KeyError, TypeError) as e:
        raise ArtifactError(f"{path / MANIFEST} is missing or has a malformed field ({e}); {REBUILD}") from None
    _check_toolchain(path, manifest)
    _check_kv_layout(path, manifest)
    for record in _all_files(manifest):
        _check_file(path, record)
    _check_no_unlisted_tokenizer_files(path, manifest)
    return manifest


def _read_manifest(path: Path) -> dict:
    f = path / MANIFEST
    if not f.is_file():
        raise ArtifactError(not_an_artifact(path))
    try:
        return json.loads(f.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{f} is corrupt ({e}); {REBUILD}") from None


def not_an_artifact(path: Path) -> str:
    """Why `path`, which holds no manifest, is not an artifact, and what to run instead."""
    if path.is_file() and path.suffix == ".gguf":
        return build_first(str(path), "model file", path.stem)
    if (path / "config.json").is_file():
        return build_first(str(path), "Hugging Face model folder", path.resolve().name)
    if inside := artifacts_inside(path):
        return f"{path} is not an artifact; it holds {_listing(inside)}"
    if not path.is_dir():
        return f"{path} is not an artifact folder; build one with `kiln build MODEL --out {path}`"
    return f"{path} has no {MANIFEST}: not a kiln artifact, or the build did not finish; {REBUILD}"


def build_first(source: str, kind: str, name: str) -> str:
    """A model source given where an artifact belongs: the build that makes one from it."""
    return (f"{source} is a {kind}, not a kiln artifact: build one first with "
            f"`kiln build {shlex.quote(source)} --out {shlex.quote(f'engines/{name}')}`")


def artifacts_inside(path: Path) -> list[Path]:
    """The artifacts directly inside `path` (engines/ for engines/smollm2); hidden folders are a
    build's temporary or replaced ones."""
    if not path.is_dir():
        return []
    return sorted(p for p in path.iterdir() if not p.name.startswith(".") and (p / MANIFEST).is_file())


def _listing(paths: list[Path], most: int = 4) -> str:
    named = ", ".join(str(p) for p in paths[:most]) + (", …" if len(paths) > most else "")
    return f"one: {named}" if len(paths) == 1 else f"{len(paths)}: {named}"


def _check_schema(path: Path, raw: dict) -> None:
    version = raw.get("schema_version")
    if not isinstance(version, int):
        raise ArtifactError(f"{path / MANIFEST} has no schema_version; {REBUILD}")
    if version > SCHEMA_VERSION:
        raise ArtifactError(
            f"{path} uses artifact schema v{version}, newer than this kiln understands (v{SCHEMA_VERSION}); "
            "upgrade kiln, or rebuild the artifact with this version")
    if version < SCHEMA_VERSION:
        raise ArtifactError(f"{path} uses an old artifact schema v{version}; {REBUILD}")


def _major_minor(version: str) -> tuple[str, ...]:
    return tuple(version.split(".")[:2])


def _check_toolchain(path: Path, m: Manifest) -> None:
    built, here = m.versions.get("onnxruntime", "?"), installed_version("onnxruntime")
    if _major_minor(built) != _major_minor(here):
        raise ArtifactError(
            f"{path} was built with onnxruntime {built}, but this runtime has {here}; "
            f"install onnxruntime=={built} or {REBUILD}")


def _check_kv_layout(path: Path, m: Manifest) -> None:
    s, kv = m.spec, m.kv_layout
    if (kv.num_layers, kv.num_kv_heads, kv.head_dim) != (s.num_layers, s.num_kv_heads, s.head_dim):
        raise ArtifactError(f"{path}: the KV layout {kv} does not match the model config; {REBUILD}")
    # NOTE: only the ORT graph reads kiln's own pool layout; other backends check their cache at load.
    for engine in (e for e in m.engines if e["backend"] == "ort"):
        for layer_input, shape in engine.get("io", {}).items():
            if layer_input.startswith("key_cache.") and (shape[0], shape[2], shape[3]) != (
                    kv.num_kv_heads, kv.block_size, kv.head_dim):
                raise ArtifactError(f"{path}: engine input {layer_input} {shape} does not match the "
                                    f"manifest's KV layout; {REBUILD}")


def _all_files(m: Manifest) -> list[dict]:
    tokenizer_files = [{"file": f, "sha256": h} for f, h in m.tokenizer.get("files", {}).items()]
    return [*(f for e in m.engines for f in _engine_files(e)), *tokenizer_files]


def _engine_files(engine: dict) -> list[dict]:
    """The engine's file and every file record inside its record (an engine's "weights" file)."""
    return [engine, *(v for v in engine.values() if isinstance(v, dict) and {"file", "sha256"} <= v.keys())]


def _check_file(path: Path, record: dict) -> None:
    f = _confined(path, record["file"])
    if not f.is_file():
        raise ArtifactError(f"{path} is incomplete: {record['file']} is missing; {REBUILD}")
    if "bytes" in record and f.stat().st_size != record["bytes"]:
        raise ArtifactError(f"{path}: {record['file']} is truncated or altered "
                            f"({f.stat().st_size} bytes, manifest says {record['bytes']}); {REBUILD}")


def _confined(path: Path, name: str) -> Path:
    """A file the manifest names must lie inside the artifact: relative, no `..`, no symlink on the way."""
    rel = Path(name)
    if rel.is_absolute() or ".." in rel.parts or not rel.parts:
        raise ArtifactError(f"{path}: the manifest names {name!r}, outside the artifact folder; {REBUILD}")
    f, here = path / rel, path
    for part in rel.parts:
        here = here / part
        if here.is_symlink():
            raise ArtifactError(f"{path}: {name} is a symbolic link; an artifact holds its own files; {REBUILD}")
    return f


def _check_no_unlisted_tokenizer_files(path: Path, m: Manifest) -> None:
    """The tokenizer loads every file its folder holds (a chat template among them), so each must be
    one the manifest lists with its sha256."""
    listed = set(m.tokenizer.get("files", {}))
    folder = path / "tokenizer"
    extra = sorted(f"tokenizer/{f.name}" for f in folder.iterdir() if f"tokenizer/{f.name}" not in listed) \
        if folder.is_dir() else []
    if extra:
        raise ArtifactError(f"{path}: {', '.join(extra)} is not listed in the manifest (an unchecked file the "
                            f"tokenizer would load); remove it or {REBUILD}")
