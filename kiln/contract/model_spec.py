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
    qk_norm: bool = False        # per-head RMSNorm of q and k before rotary (Qwen3, Gemma 3)
    # Gemma 2 / 3 (defaults: the Llama decoder)
    layer_types: tuple = ()      # per layer "sliding_attention" | "full_attention"; () = every layer alike
    local_rope_theta: float = 0.0    # rope base of sliding layers (Gemma 3); 0 = the global rope
    activation: str = "silu"     # the gated MLP's activation: silu | gelu_tanh
    norm_offset: float = 0.0     # RMSNorm scales by (offset + weight): Gemma stores weight - 1
    embed_scale: float = 1.0     # embeddings are multiplied by it (Gemma: sqrt(hidden_size))
    sandwich_norms: bool = False     # extra RMSNorm after attention and around the MLP (Gemma 2 / 3)
    query_pre_attn_scalar: float = 0.0   # scores scale by its -1/2 power; 0 = head_dim
    attn_softcap: float = 0.0    # scores -> cap * tanh(scores / cap) before the mask; 0 = none
    final_softcap: float = 0.0   # the same on the logits

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_window(self, layer: int) -> int:
        """The sliding window of one layer; 0 for full attention."""
        if self.layer_types and self.layer_types[layer] != "sliding_attention":
            return 0
        return self.sliding_window

    @property
    def query_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def config_hash(self) -> str:
        defaults = {f.name: f.default for f in fields(self) if f.default is not MISSING}
        facts = {k: v for k, v in asdict(self).items() if k not in defaults or defaults[k] != v}
        blob = json.dumps(facts, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelSpec":
        return cls(**{**d, "layer_types": tuple(d.get("layer_types", ()))})
