"""EngineArtifact: the self-describing folder a build produces and every consumer loads.

manifest.json is the single source of truth: model spec and config hash, tokenizer and chat
template hashes, generation defaults, quant mode, pass reports, bucket grid, KV layout, engine
files with sha256, toolchain versions. Loading checks all of it and refuses with a message that
says what to do; it never guesses from file names.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kiln.contract.checks import check_artifact, check_artifact_shape, verify_checksums_of
from kiln.contract.manifest import MANIFEST, ArtifactError, Manifest, current_versions, sha256_file

__all__ = ["TOKENIZER_DIR", "ArtifactWriter", "EngineArtifact", "file_record",
           # the manifest's names, for callers that only need the artifact module
           "MANIFEST", "ArtifactError", "Manifest", "current_versions", "sha256_file"]

TOKENIZER_DIR = "tokenizer"


def file_record(root: Path, path: Path) -> dict:
    return {"file": str(path.relative_to(root)), "sha256": sha256_file(path), "bytes": path.stat().st_size}


class ArtifactWriter:
    """Builds into a temporary sibling folder and renames it into place when complete,
    so a failed or interrupted build never leaves a half artifact."""

    def __init__(self, out: Path, force: bool = False):
        self.out = Path(out).resolve()
        if self.out.exists() and not force:
            raise ArtifactError(f"{self.out} already exists; pass --force to overwrite it")
        if self.out.exists():
            _refuse_to_replace_a_non_artifact(self.out)
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


def _refuse_to_replace_a_non_artifact(out: Path) -> None:
    """--force replaces an artifact, never someone's folder: it must be empty or hold a manifest."""
    if out.is_dir() and ((out / MANIFEST).is_file() or not any(out.iterdir())):
        return
    raise ArtifactError(f"{out} is not a kiln artifact (no {MANIFEST}); --force replaces artifacts only, "
                        "so choose another --out or remove it yourself")


@dataclass
class EngineArtifact:
    path: Path
    manifest: Manifest

    @property
    def tokenizer_dir(self) -> Path:
        return self.path / TOKENIZER_DIR

    @classmethod
    def load(cls, path: str | Path, verify: bool = True) -> "EngineArtifact":
        path = Path(path)
        manifest = check_artifact(path, verify_checksums=verify)
        return cls(path, manifest)

    @classmethod
    def load_verifying(cls, path: str | Path) -> tuple["EngineArtifact", Future]:
        """Every check but the checksums now; the checksums on a thread of their own (hashlib
        releases the GIL), so the engine can load meanwhile. NOTE: the caller must take the
        future's result, which raises ArtifactError on a mismatch, before it serves anything."""
        path = Path(path)
        manifest = check_artifact_shape(path)
        pool = ThreadPoolExecutor(1, thread_name_prefix="kiln-checksums")
        pending = pool.submit(verify_checksums_of, path, manifest)
        pool.shutdown(wait=False)            # the thread ends with the one task
        return cls(path, manifest), pending
