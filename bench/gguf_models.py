"""GGUF files for bench_gguf_peers.py that no registry package holds, written with the `gguf` package,
and the one GGUF writer (`write_gguf_file`) that they and the tests' tiny files
(tests/export/gguf_writing.py) go through.

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
    rng = np.random.default_rng(seed)
    tensors = ((name, _values(name, shape, rng), None) for name, shape in _tensor_shapes(s))
    write_gguf_file(tmp, "gemma3", _hparams(s) | _tokenizer(GGUFFile(tokenizer_gguf), s["vocab"]), tensors)
    tmp.rename(out)
    return out


def write_gguf_file(path: Path, arch: str, metadata: dict, tensors) -> Path:
    """A GGUF file of `arch` at `path`. `metadata` maps the name of a GGUFWriter `add_` method, less
    the prefix (context_length, token_list, ...), to its value; None values are not written. `tensors`
    yields (name, array, raw GGML type or None for the array's own dtype)."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        if value is not None:
            getattr(w, f"add_{key}")(value)
    for name, data, raw_dtype in tensors:
        w.add_tensor(name, data, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def hparams(*, context: int, hidden: int, layers: int, ffn: int, heads: int, kv_heads: int, head_dim: int,
            eps: float, rope_base: float, window: int | None = None, rope_dims: int | None = None) -> dict:
    """A decoder's shape as `write_gguf_file` metadata (key and value lengths both `head_dim`)."""
    return dict(context_length=context, embedding_length=hidden, block_count=layers, feed_forward_length=ffn,
                head_count=heads, head_count_kv=kv_heads, key_length=head_dim, value_length=head_dim,
                rope_dimension_count=rope_dims, layer_norm_rms_eps=eps, rope_freq_base=rope_base,
                sliding_window=window)


def tokenizer_metadata(*, model: str, tokens: list, types: list, merges=None, scores=None, pre=None, bos=None,
                       eos=None, pad=None, unk=None, add_bos=None, template=None) -> dict:
    """A tokenizer as `write_gguf_file` metadata; what is None (or empty) is left out."""
    return dict(tokenizer_model=model, tokenizer_pre=pre, token_list=tokens, token_types=types,
                token_merges=merges or None, token_scores=scores or None, bos_token_id=bos, eos_token_id=eos,
                pad_token_id=pad, unk_token_id=unk, add_bos_token=add_bos, chat_template=template)


def _hparams(s: dict) -> dict:
    return hparams(**{k: s[k] for k in ("context", "hidden", "layers", "ffn", "heads", "kv_heads", "head_dim",
                                         "eps", "rope_base", "window")})


def _tokenizer(src: GGUFFile, vocab: int) -> dict:
    tokens, types = src.get("tokenizer.ggml.tokens"), [int(t) for t in src.get("tokenizer.ggml.token_type")]
    unused = vocab - len(tokens)
    # NOTE: normal entries no merge reaches, so neither tokenizer ever produces them
    return tokenizer_metadata(
        model=src.get("tokenizer.ggml.model"), tokens=tokens + [f"<unused{i}>" for i in range(unused)],
        types=types + [gguf.TokenType.NORMAL] * unused, merges=src.get("tokenizer.ggml.merges"),
        pre=src.get("tokenizer.ggml.pre"), bos=src.get("tokenizer.ggml.bos_token_id"),
        eos=src.get("tokenizer.ggml.eos_token_id"), pad=src.get("tokenizer.ggml.padding_token_id"),
        unk=src.get("tokenizer.ggml.unknown_token_id"), add_bos=src.get("tokenizer.ggml.add_bos_token"),
        template=src.get("tokenizer.chat_template"))


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
