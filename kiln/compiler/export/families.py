"""The registry of model families kiln exports: HF `model_type` -> how to read its config.

Every family here is the same decoder (RMSNorm, SwiGLU, rotate-half rotary, grouped-query
attention); a family says which variant switches its config turns on. What a family cannot run
faithfully is refused here, before any weight is read, with the supported list.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

from kiln.compiler.export import gemma
from kiln.compiler.export.rope import ROPE_TYPES, check_rope, read_rope
from kiln.contract.model_spec import ModelSpec, UnsupportedModelError


@dataclass(frozen=True)
class Family:
    name: str
    attention_bias: Callable[[dict], bool]
    qk_norm: bool = False
    fused_projections: bool = False   # checkpoint holds qkv_proj / gate_up_proj (Phi-3)
    sliding_window: Callable[[dict], int] = lambda cfg: 0
    activation: str = "silu"          # the HF hidden_act the graph implements
    activation_aliases: tuple = ()    # other hidden_act values HF itself runs as `activation`
    rope: Callable[[dict], tuple[str, dict]] = read_rope
    extras: Callable[[dict], dict] = lambda cfg: {}    # further ModelSpec fields (Gemma)


def _llama_bias(cfg: dict) -> bool:
    # NOTE: in Llama, Mistral and Qwen3, attention_bias also puts a bias on o_proj, which the
    # graph does not carry; refusing beats a silently wrong model.
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise UnsupportedModelError(f"{cfg['model_type']} with attention_bias/mlp_bias is not supported")
    return False


def _window_everywhere(cfg: dict) -> int:
    """Mistral / Phi-3: `sliding_window` applies to every layer when set."""
    return _effective_window(cfg, cfg.get("sliding_window"))


def _effective_window(cfg: dict, window) -> int:
    # A window as long as the context hides nothing (Phi-3.5's 262144 over 131072 positions).
    if not window or window >= cfg.get("max_position_embeddings", 2048):
        return 0
    return int(window)


def _qwen_window(cfg: dict) -> int:
    """Qwen2/3 use a window only with use_sliding_window, and then only from max_window_layers on."""
    if not cfg.get("use_sliding_window") or not cfg.get("sliding_window"):
        return 0
    if "sliding_attention" not in _qwen_layer_types(cfg):
        return 0                      # every layer is full attention
    return _effective_window(cfg, cfg["sliding_window"])


def _qwen_layer_types(cfg: dict) -> tuple[str, ...]:
    first_sliding = cfg.get("max_window_layers", 28)
    return tuple(cfg.get("layer_types") or ("sliding_attention" if i >= first_sliding else "full_attention"
                                            for i in range(cfg["num_hidden_layers"])))


def _qwen_extras(cfg: dict) -> dict:
    """Sliding and full layers mixed (max_window_layers between 0 and the layer count)."""
    types = _qwen_layer_types(cfg)
    return {"layer_types": types} if _qwen_window(cfg) and len(set(types)) > 1 else {}


FAMILIES: dict[str, Family] = {
    # Llama 1/2/3.x and SmolLM: GQA, RMSNorm, SwiGLU, rotate-half RoPE (rope_scaling per rope.py).
    "llama": Family("llama", _llama_bias),
    "mistral": Family("mistral", _llama_bias, sliding_window=_window_everywhere),
    # Qwen2 / Qwen2.5: Llama with biases on q/k/v.
    "qwen2": Family("qwen2", lambda cfg: True, sliding_window=_qwen_window, extras=_qwen_extras),
    # Qwen3: per-head RMSNorm on q and k before rotary; no q/k/v bias by default.
    "qwen3": Family("qwen3", _llama_bias, qk_norm=True, sliding_window=_qwen_window, extras=_qwen_extras),
    # Phi-3 / Phi-3.5 / Phi-4-mini: fused qkv_proj and gate_up_proj (split at load), partial rotary, longrope.
    "phi3": Family("phi3", lambda cfg: False, fused_projections=True, sliding_window=_window_everywhere),
    # Gemma / Gemma 2 / Gemma 3 (text): see kiln.compiler.export.gemma. Gemma's config.json says "gelu",
    # which GemmaConfig itself replaces by the tanh approximation it was trained with.
    "gemma": Family("gemma", _llama_bias, activation="gelu_pytorch_tanh", activation_aliases=("gelu",),
                    extras=gemma.gemma_extras),
    "gemma2": Family("gemma2", _llama_bias, activation="gelu_pytorch_tanh", extras=gemma.gemma2_extras),
    "gemma3_text": Family("gemma3", _llama_bias, qk_norm=True, activation="gelu_pytorch_tanh",
                          rope=gemma.gemma3_rope, extras=gemma.gemma3_extras),
}

# Named in the refusal so a user sees what would build, not only what did not.
SUPPORTED = ("llama (Llama 1/2/3.x, SmolLM), mistral (sliding window), qwen2 (Qwen2/2.5), qwen3, "
             "phi3 (Phi-3/3.5, Phi-4-mini), gemma, gemma2, gemma3_text (Gemma 3 text-only); rope types "
             + ", ".join(ROPE_TYPES))


def family_for(model_type: str) -> Family:
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise UnsupportedModelError(f"unsupported architecture {model_type!r}: kiln exports {SUPPORTED}") from None


def spec_from_hf_config(cfg: dict) -> ModelSpec:
    """Read an HF config.json dict into a ModelSpec, refusing what kiln cannot run faithfully."""
    family = family_for(cfg.get("model_type", "<missing model_type>"))
    _refuse_unsupported_features(cfg, family)
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope_type, rope_params = family.rope(cfg)
    partial = float(rope_params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    check_rope(rope_type, rope_params, int(head_dim * partial))
    facts = dict(
        family=family.name,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        intermediate_size=cfg["intermediate_size"],
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_params.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=family.attention_bias(cfg),
        rope_type=rope_type,
        rope_scaling=_rope_json(rope_type, rope_params),
        partial_rotary_factor=partial,
        sliding_window=family.sliding_window(cfg),
        qk_norm=family.qk_norm,
    )
    return ModelSpec(**(facts | family.extras(cfg)))


def _rope_json(rope_type: str, params: dict) -> str:
    if rope_type == "default":
        return ""
    keep = {k: v for k, v in params.items() if k not in ("rope_type", "type", "rope_theta", "partial_rotary_factor")}
    return json.dumps(keep, sort_keys=True)


def _refuse_unsupported_features(cfg: dict, family: Family) -> None:
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or family.activation
    if act != family.activation and act not in family.activation_aliases:
        raise UnsupportedModelError(f"activation {act!r} is not supported for {family.name} "
                                    f"(kiln runs its gated MLP with {family.activation})")
    for key in ("num_attention_heads", "hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size"):
        if not isinstance(cfg.get(key), int):
            raise UnsupportedModelError(f"config.json has no integer {key!r}")


def expected_shapes(spec: ModelSpec, fused: bool = False) -> dict[str, tuple[int, ...]]:
    """Every tensor the exporter reads, HF-named, with the shape the config implies."""
    h, hd, inter = spec.hidden_size, spec.head_dim, spec.intermediate_size
    q, kv = spec.num_heads * hd, spec.num_kv_heads * hd
    shapes = {"model.embed_tokens.weight": (spec.vocab_size, h), "model.norm.weight": (h,)}
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.o_proj.weight": (h, q), p + "mlp.down_proj.weight": (h, inter)}
        if fused:
            shapes |= {p + "self_attn.qkv_proj.weight": (q + 2 * kv, h), p + "mlp.gate_up_proj.weight": (2 * inter, h)}
        else:
            shapes |= {p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "mlp.gate_proj.weight": (inter, h),
                       p + "mlp.up_proj.weight": (inter, h)}
        if spec.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)}
        if spec.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)}
        if spec.sandwich_norms:
            shapes |= {p + "pre_feedforward_layernorm.weight": (h,), p + "post_feedforward_layernorm.weight": (h,)}
    return shapes


def split_fused(weights, spec: ModelSpec) -> None:
    """Phi-3's qkv_proj -> q/k/v_proj and gate_up_proj -> gate/up_proj (a checkpoint.LazyWeights).

    MergeProjections fuses them back at build time; splitting keeps one graph for every family.
    """
    q, kv, inter = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.intermediate_size
    for i in range(spec.num_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        weights.split(a + "qkv_proj.weight", {a + "q_proj.weight": slice(0, q), a + "k_proj.weight": slice(q, q + kv),
                                              a + "v_proj.weight": slice(q + kv, None)})
        weights.split(m + "gate_up_proj.weight", {m + "gate_proj.weight": slice(0, inter),
                                                  m + "up_proj.weight": slice(inter, None)})
