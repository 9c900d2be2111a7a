"""EngineArtifact: the self-describing folder a build produces and every consumer loads.

manifest.json is the single source of truth: model spec and config hash, tokenizer and chat
template hashes, generation defaults, quant mode, pass reports, bucket grid, KV layout, engine
files with sha256, toolchain versions. Loading checks all of it and refuses with a message that
says what to do; it never guesses from file names.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import onnxruntime

import kiln
from kiln.engines.base import BucketGrid, KvLayout
from kiln.export.spec import ModelSpec

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
TOKENIZER_DIR = "tokenizer"


class ArtifactError(RuntimeError):
    """The artifact cannot be used; the message says why and what to do."""


@dataclass
class Manifest:
    spec: ModelSpec
    quant: dict
    buckets: BucketGrid
    kv_layout: KvLayout
    engines: list[dict]                       # backend, file, sha256, bytes, io
    generation: dict                          # eos_token_ids, bos_token_id, max_model_len, ...
    tokenizer: dict = field(default_factory=dict)  # files -> sha256, chat_template_sha256
    passes: list[dict] = field(default_factory=list)
    source: str = ""
    versions: dict = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION

    def to_json(self) -> dict:
        return {
            "schema_version": self.schema_version,
            "model": {"family": self.spec.family, "config": self.spec.to_dict(),
                      "config_hash": self.spec.config_hash(), "source": self.source},
            "quant": self.quant, "buckets": self.buckets.to_dict(), "kv_layout": self.kv_layout.to_dict(),
            "engines": self.engines, "generation": self.generation, "tokenizer": self.tokenizer,
            "passes": self.passes, "versions": self.versions,
        }

    @classmethod
    def from_json(cls, d: dict) -> "Manifest":
        return cls(spec=ModelSpec.from_dict(d["model"]["config"]), quant=d["quant"],
                   buckets=BucketGrid.from_dict(d["buckets"]), kv_layout=KvLayout(**d["kv_layout"]),
                   engines=d["engines"], generation=d["generation"], tokenizer=d["tokenizer"],
                   passes=d["passes"], source=d["model"].get("source", ""), versions=d["versions"],
                   schema_version=d["schema_version"])


def current_versions() -> dict:
    return {"kiln": kiln.__version__, "onnxruntime": onnxruntime.__version__}


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def file_record(root: Path, path: Path) -> dict:
    return {"file": str(path.relative_to(root)), "sha256": sha256_file(path), "bytes": path.stat().st_size}


class ArtifactWriter:
    """Builds into a temporary sibling folder and renames it into place when complete,
    so a failed or interrupted build never leaves a half artifact."""

    def __init__(self, out: Path, force: bool = False):
        self.out = Path(out).resolve()
        if self.out.exists() and not force:
            raise ArtifactError(f"{self.out} already exists; pass --force to overwrite it")
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.building-", dir=self.out.parent))

    def __enter__(self) -> "ArtifactWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def commit(self, manifest: Manifest) -> Path:
        (self.tmp / MANIFEST).write_text(json.dumps(manifest.to_json(), indent=1))
        if self.out.exists():
            old = self.out.with_name(f".{self.out.name}.old-{os.getpid()}")
            self.out.rename(old)
            self.tmp.rename(self.out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            self.tmp.rename(self.out)
        return self.out


@dataclass
class EngineArtifact:
    path: Path
    manifest: Manifest

    @property
    def tokenizer_dir(self) -> Path:
        return self.path / TOKENIZER_DIR

    def engine_file(self, backend: str = "ort") -> Path:
        for e in self.manifest.engines:
            if e["backend"] == backend:
                return self.path / e["file"]
        raise ArtifactError(f"{self.path} has no {backend} engine; rebuild with `kiln build --backend {backend}`")

    @classmethod
    def load(cls, path: str | Path, verify: bool = True) -> "EngineArtifact":
        from kiln.artifact_checks import check_artifact

        path = Path(path)
        manifest = check_artifact(path, verify_checksums=verify)
        return cls(path, manifest)
