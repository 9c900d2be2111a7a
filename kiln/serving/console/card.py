"""The artifact card: what the console shows about the loaded artifact and the KV pool it sized.
The manifest's facts (kiln inspect shows the same), plus the runtime's plan, which the manifest
cannot know."""

from __future__ import annotations

# Quantization entries that describe the build's check rather than the mode (shown apart).
_CHECK_KEYS = ("check_text", "check_tokens", "top1_agreement", "min_top1_agreement", "perplexity", "perplexity_fp32")


def artifact_card(m, plan, model_name: str, max_model_len: int) -> dict:
    """`m`: the artifact's manifest; `plan`: the KV plan (the engine snapshot's kv_plan)."""
    return {
        "model": model_name,
        "architecture": _architecture(m.spec),
        "source": m.source,
        "config_hash": m.spec.config_hash(),
        "quantization": _quantization(m.quant),
        "buckets": m.buckets.to_dict(),
        "kv": _kv(m.kv_layout, plan),
        "max_model_len": max_model_len,
        "engines": [{k: e[k] for k in ("backend", "file", "bytes") if k in e} for e in m.engines],
        "passes": [_pass(r) for r in m.passes],
        "versions": m.versions,
    }


def _architecture(s) -> dict:
    return {"family": s.family, "layers": s.num_layers, "hidden": s.hidden_size, "heads": s.num_heads,
            "kv_heads": s.num_kv_heads, "vocab": s.vocab_size}


def _quantization(q: dict) -> dict:
    card = {"mode": q.get("mode"),
            "settings": {k: v for k, v in q.items()
                         if k != "mode" and k not in _CHECK_KEYS and not isinstance(v, (dict, list))}}
    if "perplexity" in q:
        card["check"] = {k: q[k] for k in _CHECK_KEYS if k in q}
    return card


def _kv(layout, plan) -> dict:
    return {"layers": layout.num_layers, "kv_heads": layout.num_kv_heads, "head_dim": layout.head_dim,
            "block_size": layout.block_size, "dtype": layout.dtype, "bytes_per_token": layout.bytes_per_token,
            "blocks": plan.num_blocks, "tokens": plan.num_tokens, "sequences": plan.num_sequences,
            "context_len": plan.context_len, "bytes": plan.num_blocks * plan.bytes_per_block}


def _pass(r: dict) -> dict:
    return {k: r.get(k) for k in ("name", "nodes_before", "nodes_after", "seconds", "max_abs_error", "max_rel_error")}
