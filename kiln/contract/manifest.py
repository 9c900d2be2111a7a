"""The artifact manifest: schema, JSON form, and the error every artifact refusal raises.

It sits below kiln.contract.artifact (the folder: writer and loader) and kiln.contract.checks (load-time
checks), so both read it without importing each other.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
from dataclasses import dataclass, field
from pathlib import Path

from kiln.contract.engine import BucketGrid, KvLayout
from kiln.contract.model_spec import ModelSpec

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"


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
    choices: dict = field(default_factory=dict)   # backend / quant: value, chosen_by (auto | user), reason
    # The build plan, verbatim (kiln.compiler.plan.BuildPlan.to_dict): every choice with its reason.
    # Optional: artifacts built before it have none ({}), and load as they did.
    plan: dict = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION

    def to_json(self) -> dict:
        return {
            "schema_version": self.schema_version,
            "model": {"family": self.spec.family, "config": self.spec.to_dict(),
                      "config_hash": self.spec.config_hash(), "source": self.source},
            "quant": self.quant, "buckets": self.buckets.to_dict(), "kv_layout": self.kv_layout.to_dict(),
            "engines": self.engines, "generation": self.generation, "tokenizer": self.tokenizer,
            "passes": self.passes, "versions": self.versions, "choices": self.choices,
            **({"plan": self.plan} if self.plan else {}),
        }

    @classmethod
    def from_json(cls, d: dict) -> "Manifest":
        return cls(spec=ModelSpec.from_dict(d["model"]["config"]), quant=d["quant"],
                   buckets=BucketGrid.from_dict(d["buckets"]), kv_layout=KvLayout(**d["kv_layout"]),
                   engines=d["engines"], generation=d["generation"], tokenizer=d["tokenizer"],
                   passes=d["passes"], source=d["model"].get("source", ""), versions=d["versions"],
                   choices=d.get("choices", {}), plan=d.get("plan", {}), schema_version=d["schema_version"])


def current_versions() -> dict:
    # NOTE: the installed distributions' versions, read without importing them (importing
    # onnxruntime costs a noticeable part of every start, and an openvino artifact never runs it)
    return {"kiln": importlib.metadata.version("kiln"), "onnxruntime": installed_version("onnxruntime")}


def installed_version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
