"""ModelSpec: the architecture facts the exporter needs, read from an HF config dict."""

from __future__ import annotations

import hashlib
import json
from dataclasses import MISSING, asdict, dataclass, fields


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
    # NOTE: fields below have defaults so manifests written before them still load, and
    # config_hash() leaves a field at its default out, so those manifests keep their hash.
    rope_type: str = "default"   # HF rope_type: default, linear, dynamic, yarn, llama3, longrope
    rope_scaling: str = ""       # the HF rope parameters as sorted JSON; export.rope reads them
    partial_rotary_factor: float = 1.0   # the leading fraction of head_dim that rotary touches
    sliding_window: int = 0      # 0: full attention; else a key is visible iff query_pos - key_pos < window
    qk_norm: bool = False        # per-head RMSNorm of q and k before rotary (Qwen3)

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def config_hash(self) -> str:
        defaults = {f.name: f.default for f in fields(self) if f.default is not MISSING}
        facts = {k: v for k, v in asdict(self).items() if k not in defaults or defaults[k] != v}
        blob = json.dumps(facts, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelSpec":
        return cls(**d)
