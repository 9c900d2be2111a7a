"""ModelSpec: the architecture facts the exporter needs, read from an HF config dict."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass


class UnsupportedModelError(ValueError):
    """The model source names an architecture kiln cannot export."""


@dataclass(frozen=True)
class ModelSpec:
    family: str                  # a key of export.families.FAMILIES
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool         # q/k/v projections carry a bias (Qwen2)

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def config_hash(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelSpec":
        return cls(**d)
