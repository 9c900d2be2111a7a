"""GGUF files for bench_gguf_peers.py that no registry package holds, written with the `gguf` package.

`write_gemma3_270m_shape`: a Gemma 3 with google/gemma-3-270m's shapes (18 layers, hidden 640, 4
query heads and 1 KV head of 256, MLP 2048, a 262,144-token vocabulary, sliding window 512 on five
layers of six) and seeded random weights, written in f16 as llama.cpp's converter lays a Gemma 3
out (norms stored as w + 1, the embedding tied to the output). Speed depends on the shapes, not the
weights; the answers are noise. The vocabulary is SmolLM2's byte-level BPE (so the prompts'
token ids are real text) padded with unused entries to Gemma 3's size, so the embedding and the LM
head cost what Gemma 3's do. llama.cpp's own quantizer then writes the Q4_K_M file from it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

import gguf
from kiln.compiler.export.gguf_reader import GGUFFile

GEMMA3_270M = dict(layers=18, hidden=640, heads=4, kv_heads=1, head_dim=256, ffn=2048, vocab=262_144,
                   window=512, context=32_768, eps=1e-6, rope_base=1e6)


def write_gemma3_270m_shape(out: Path, tokenizer_gguf: Path, seed: int = 0, shape: dict = GEMMA3_270M) -> Path:
    """The file at `out` (kept if it is there); `shape` other than 270M's for tests."""
    if out.is_file():
        return out
    s = shape
    tmp = out.with_name(out.name + ".tmp")
    out.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(tmp), "gemma3")
    _hparams(w, s)
    _tokenizer(w, GGUFFile(tokenizer_gguf), s["vocab"])
    rng = np.random.default_rng(seed)
    for name, shape in _tensor_shapes(s):
        w.add_tensor(name, _values(name, shape, rng))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(out)
    return out


def _hparams(w: gguf.GGUFWriter, s: dict) -> None:
    w.add_context_length(s["context"])
    w.add_embedding_length(s["hidden"])
    w.add_block_count(s["layers"])
    w.add_feed_forward_length(s["ffn"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_key_length(s["head_dim"])
    w.add_value_length(s["head_dim"])
    w.add_layer_norm_rms_eps(s["eps"])
    w.add_rope_freq_base(s["rope_base"])
    w.add_sliding_window(s["window"])


def _tokenizer(w: gguf.GGUFWriter, src: GGUFFile, vocab: int) -> None:
    tokens, types = src.get("tokenizer.ggml.tokens"), [int(t) for t in src.get("tokenizer.ggml.token_type")]
    unused = vocab - len(tokens)
    # NOTE: normal entries no merge reaches, so neither tokenizer ever produces them
    w.add_token_list(tokens + [f"<unused{i}>" for i in range(unused)])
    w.add_token_types(types + [gguf.TokenType.NORMAL] * unused)
    w.add_token_merges(src.get("tokenizer.ggml.merges"))
    w.add_tokenizer_model(src.get("tokenizer.ggml.model"))
    for key, add in (("tokenizer.ggml.pre", w.add_tokenizer_pre), ("tokenizer.ggml.bos_token_id", w.add_bos_token_id),
                     ("tokenizer.ggml.eos_token_id", w.add_eos_token_id),
                     ("tokenizer.ggml.padding_token_id", w.add_pad_token_id),
                     ("tokenizer.ggml.unknown_token_id", w.add_unk_token_id),
                     ("tokenizer.ggml.add_bos_token", w.add_add_bos_token),
                     ("tokenizer.chat_template", w.add_chat_template)):
        if (value := src.get(key)) is not None:
            add(value)


def _tensor_shapes(s: dict):
    h, q, kv, ffn = s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"], s["ffn"]
    yield "token_embd.weight", (s["vocab"], h)
    for i in range(s["layers"]):
        b = f"blk.{i}"
        yield from [(f"{b}.attn_norm.weight", (h,)), (f"{b}.attn_q.weight", (q, h)), (f"{b}.attn_k.weight", (kv, h)),
                    (f"{b}.attn_v.weight", (kv, h)), (f"{b}.attn_output.weight", (h, q)),
                    (f"{b}.attn_q_norm.weight", (s["head_dim"],)), (f"{b}.attn_k_norm.weight", (s["head_dim"],)),
                    (f"{b}.post_attention_norm.weight", (h,)), (f"{b}.ffn_norm.weight", (h,)),
                    (f"{b}.ffn_gate.weight", (ffn, h)), (f"{b}.ffn_up.weight", (ffn, h)),
                    (f"{b}.ffn_down.weight", (h, ffn)), (f"{b}.post_ffw_norm.weight", (h,))]
    yield "output_norm.weight", (h,)


def _values(name: str, shape: tuple[int, ...], rng) -> np.ndarray:
    if len(shape) == 1:         # a Gemma norm as llama.cpp stores it: 1 + w, here w ~ 0.1 N(0, 1)
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    scale = 1.0 if name.startswith("token_embd") else shape[1] ** -0.5
    return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float16)
