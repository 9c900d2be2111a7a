"""Perplexity of a standard-interface decoder graph on a token sequence.

The text is fed in chunks of `window` tokens with the KV cache carried from chunk to chunk, so every
token sees the whole text before it and the cost stays linear in its length (batch 1). Log-softmax
sums in fp64 so that the metric's own rounding is far below a quantization delta.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from kiln.engines.ort.session import cpu_session
from kiln.compiler.export.external import session_config

PERPLEXITY_TEXT = Path(__file__).resolve().parents[3] / "tests" / "data" / "perplexity.txt"
# Shipped in the package: the build's quantization check and the manifest's perplexity use it.
CHECK_TEXT = Path(__file__).resolve().parents[2] / "data" / "check.txt"


def perplexity(model: onnx.ModelProto | str, token_ids: list[int], window: int = 512) -> float:
    """exp(mean negative log-likelihood) of token_ids[1:], each predicted from all tokens before it."""
    if len(token_ids) < 2:
        raise ValueError("perplexity needs at least two tokens")
    return float(np.exp(_total_nll(make_session(model), token_ids, window) / (len(token_ids) - 1)))


def make_session(model: onnx.ModelProto | str, threads: int = 2) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
    opts.log_severity_level = 3
    if threads == 1:        # NOTE: no spinning, so CPU time measures work (bench_quant_ppl --cpu-time)
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if not isinstance(model, str):
        for key, value in session_config(model).items():     # where external weights live
            opts.add_session_config_entry(key, value)
    source = model if isinstance(model, str) else model.SerializeToString()
    return cpu_session(source, opts)


def text_logits(model: onnx.ModelProto | str, token_ids: list[int]) -> np.ndarray:
    """[n, vocab] logits of one run over token_ids (batch 1, no past): for short texts."""
    ids = np.asarray(token_ids, np.int64)
    sess = make_session(model)
    return _step(sess, ids, 0, empty_cache(sess))[0]


def perplexity_of_logits(logits: np.ndarray, token_ids: list[int]) -> float:
    """exp(mean NLL) of token_ids[1:] given logits [n, vocab] for token_ids (the last row is unused)."""
    targets = np.asarray(token_ids[1:], np.int64)
    return float(np.exp(-_log_probs(logits[:len(targets)], targets).mean()))


def greedy_tokens(model: onnx.ModelProto | str, prompt_ids: list[int], max_new: int,
                  stop_ids: tuple[int, ...] = ()) -> list[int]:
    """Greedy continuation of a prompt (batch 1, KV cache carried): quality spot checks, not serving."""
    sess = make_session(model)
    logits, cache = _step(sess, np.asarray(prompt_ids, np.int64), 0, empty_cache(sess))
    out: list[int] = []
    while len(out) < max_new:
        out.append(int(logits[-1].argmax()))
        if out[-1] in stop_ids:
            break
        logits, cache = _step(sess, np.asarray(out[-1:], np.int64), len(prompt_ids) + len(out) - 1, cache)
    return out


def _total_nll(sess: ort.InferenceSession, token_ids: list[int], window: int) -> float:
    ids = np.asarray(token_ids, np.int64)
    cache = empty_cache(sess)
    nll = 0.0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start:start + window]
        logits, cache = _step(sess, chunk, start, cache)
        targets = ids[start + 1:start + 1 + len(chunk)]          # the last chunk has one fewer
        nll -= _log_probs(logits[:len(targets)], targets).sum()
    return nll


def _step(sess: ort.InferenceSession, chunk: np.ndarray, start: int, cache: dict) -> tuple[np.ndarray, dict]:
    feeds = {
        "input_ids": chunk[None],
        "position_ids": np.arange(start, start + len(chunk), dtype=np.int64)[None],
        "attention_mask": np.ones((1, start + len(chunk)), np.int64),
        **cache,
    }
    names = [o.name for o in sess.get_outputs()]
    outputs = dict(zip(names, sess.run(names, feeds)))
    present = {n.replace("present.", "past_key_values.", 1): v for n, v in outputs.items()
               if n.startswith("present.")}
    return outputs["logits"][0], present


def empty_cache(sess: ort.InferenceSession) -> dict:
    # past inputs are [batch, kv_heads, past, head_dim]; an empty past has past = 0.
    return {i.name: np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32)
            for i in sess.get_inputs() if i.name.startswith("past_key_values.")}


def _log_probs(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Log-softmax at the targets, one row at a time: the sum of exponentials in fp64, each term
    exact to fp32 (they are at most 1), so no fp64 copy of a large vocabulary's logits is made."""
    rows = np.arange(len(targets))
    top = logits[rows].max(axis=-1).astype(np.float64)
    log_z = np.array([np.log(np.exp(row - np.float32(m)).sum(dtype=np.float64)) for row, m in zip(logits, top)])
    return (logits[rows, targets].astype(np.float64) - top) - log_z


def text_token_ids(tokenizer_dir: Path, text_path: Path = PERPLEXITY_TEXT) -> list[int]:
    """The evaluation text tokenized with a model's tokenizer.json (no special tokens added)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    return tokenizer.encode(Path(text_path).read_text(encoding="utf-8"), add_special_tokens=False).ids
