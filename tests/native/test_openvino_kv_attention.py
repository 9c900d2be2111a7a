"""kiln's paged attention for OpenVINO (kiln.PagedAttentionU8 / kiln.PagedAttentionF16) against numpy:
one layer, several sequences in one packed call, over prefills, chunked prefills and decodes, with
block tables out of order, so every call reads what earlier calls stored in the bound caches."""

from __future__ import annotations

import numpy as np
import pytest

ov = pytest.importorskip("openvino")

from openvino import opset13 as ops  # noqa: E402

from kiln.engines.openvino import native  # noqa: E402
from kiln.engines.openvino.kiln_attention import (BLOCK_SIZE, KILN_F16, KILN_U8, attention_inputs,  # noqa: E402
                                                  dequantize_block, operation)

pytestmark = pytest.mark.skipif(not native.available(), reason="kiln's OpenVINO op library is not built")

HEADS, KV_HEADS = 6, 2
SEQS, BLOCKS_PER_SEQ = 3, 6
# new tokens per sequence and call: a prefill of several 16-token runs and a remainder, decodes,
# a chunk continuing a prefill, a single token beside a long chunk
CALLS = [[37, 5, 20], [1, 1, 1], [1, 30, 1], [2, 3, 18], [50, 1, 1]]


def _parameter(name, element_type, shape):
    p = ops.parameter(ov.PartialShape(shape), element_type, name=name)
    p.output(0).get_tensor().set_names({name})
    return p


class Layer:
    """One compiled attention layer with its caches bound, as the engine binds them."""

    def __init__(self, fmt, head_dim, window, tmp_path, seqs=SEQS):
        self.fmt, self.hd, self.window, self.seqs = fmt, head_dim, window, seqs
        q = _parameter("q", ov.Type.f32, [-1, HEADS * head_dim])
        k, v = (_parameter(n, ov.Type.f32, [-1, KV_HEADS * head_dim]) for n in "kv")
        row = fmt.row_bytes(head_dim)
        caches = [_parameter(n, ov.Type.u8, [-1, KV_HEADS, BLOCK_SIZE, row]) for n in ("key_cache", "value_cache")]
        seq = {n: _parameter(n, ov.Type.i32, [-1])
               for n in ("past_lens", "subsequence_begins", "block_indices", "block_indices_begins")}
        node = operation(fmt, attention_inputs(q, k, v, *caches, seq, head_dim ** -0.5, window))
        ov.save_model(ov.Model([node.output(0)], [q, k, v, *caches, *seq.values()]), tmp_path / "layer.xml")
        core = ov.Core()
        core.add_extension(str(native.LIBRARY))
        compiled = core.compile_model(core.read_model(tmp_path / "layer.xml"), "CPU", {"INFERENCE_NUM_THREADS": 2})
        self.request = compiled.create_infer_request()
        shape = (seqs * BLOCKS_PER_SEQ, KV_HEADS, BLOCK_SIZE, row)
        self.keys, self.values = np.zeros(shape, np.uint8), np.zeros(shape, np.uint8)
        self.request.set_tensor("key_cache", ov.Tensor(self.keys, shared_memory=True))
        self.request.set_tensor("value_cache", ov.Tensor(self.values, shared_memory=True))
        # each sequence's blocks, out of order and interleaved with the others'
        self.tables = [list(range(seqs * BLOCKS_PER_SEQ))[b::seqs][::-1] for b in range(seqs)]

    def call(self, past, q, k, v, short_of_blocks=0):
        counts = [len(x) for x in q]
        used = [-(-(p + c) // BLOCK_SIZE) - short_of_blocks for p, c in zip(past, counts)]
        feeds = {"q": np.concatenate(q).reshape(sum(counts), -1), "k": np.concatenate(k).reshape(sum(counts), -1),
                 "v": np.concatenate(v).reshape(sum(counts), -1), "past_lens": np.array(past, np.int32),
                 "subsequence_begins": np.cumsum([0, *counts]).astype(np.int32),
                 "block_indices": np.concatenate([t[:n] for t, n in zip(self.tables, used)]).astype(np.int32),
                 "block_indices_begins": np.cumsum([0, *used]).astype(np.int32)}
        out = self.request.infer(feeds)[0].reshape(sum(counts), HEADS, self.hd)
        return np.split(out, np.cumsum(counts)[:-1])

    def cached(self, b, n, keys):
        """The first n tokens of sequence b as the cache holds them, [n, kv heads, hd]."""
        cache = self.keys if keys else self.values
        blocks = [dequantize_block(cache, blk, self.hd, keys, self.fmt) for blk in self.tables[b]]
        return np.concatenate(blocks, axis=1)[:, :n].transpose(1, 0, 2)


def bf16(x):
    """x rounded to bfloat16 (to nearest, ties to even), as float32."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)


def attention(q, keys, values, past, window, head_dim, rounded=lambda x: x):
    """softmax(q k^T / sqrt(hd)) v per query token and head, causal, over the last `window` keys;
    rounded (bf16 for the tiles' path) applies to the values and the unnormalized weights."""
    out = np.zeros_like(q)
    values = rounded(values)
    for i in range(len(q)):
        first = max(0, past + i + 1 - window) if window else 0
        for h in range(HEADS):
            g = h // (HEADS // KV_HEADS)
            s = keys[first:past + i + 1, g] @ q[i, h] * head_dim ** -0.5
            w = rounded(np.exp(s - s.max()))
            out[i, h] = (w / w.sum()) @ values[first:past + i + 1, g]
    return out


def on_tiles(head_dim, new_tokens):
    """Whether the library computes this sequence's call on AMX-BF16 tiles: a run of several tokens
    (more than four query vectors) whose head width is a multiple of 32, where the CPU has them."""
    return (native.attention_level() == "amx-bf16" and head_dim % 32 == 0 and new_tokens > 1
            and new_tokens * HEADS // KV_HEADS > 4)


def on_code_words(fmt, head_dim, new_tokens):
    """Whether the library computes this sequence's call with integer products over the u8 cache's
    code words, each new token as a decode of its own position: where the CPU has AVX-512 VNNI and
    the call does not go to the tiles."""
    return fmt is KILN_U8 and native.decode_level() == "avx512vnni" and not on_tiles(head_dim, new_tokens)


# On code words a query vector, and each block's weights, are split into two signed bytes,
# x = (high + low / 254) * max|x| / 127 (paged_kv_decode_vnni.cc): each element to 1/(127 * 508) of
# its vector's largest, rounded to nearest.
SPLIT = 1 / (127 * 508)


def split(x):
    """A vector as the decode kernel splits it (the same f32 operations, ties to even), as float64."""
    x = np.asarray(x, np.float32)
    amax = np.abs(x).max()
    if amax == 0:
        return np.zeros(x.shape)
    t = x * np.float32(np.float32(127) / amax)
    high = np.rint(t)
    low = np.rint((t - high).astype(np.float32) * np.float32(254))
    return (high + low / 254) * (np.float64(amax) / 127)


def over_code_words(q, keys, values, past, window, head_dim):
    """The call's attention as the code-word kernel computes it (token i a decode of position past + i),
    and a bound on its distance from that: the queries split exactly as the kernel splits them; the
    weights' split moves each weight of a block by at most SPLIT of the block's largest (relative to
    the final largest score; a code is at most 255 value steps), over the weights' total."""
    group = HEADS // KV_HEADS
    out, bound = np.zeros((len(q), HEADS, head_dim)), np.zeros((len(q), HEADS, 1))
    step = (values.max(-1) - values.min(-1)) / 255                  # a value code's unit, [n, kv heads]
    for i in range(len(q)):
        n = past + i + 1
        first = max(0, n - window) if window else 0
        starts = range(first // BLOCK_SIZE * BLOCK_SIZE, n, BLOCK_SIZE)
        for h in range(HEADS):
            g = h // group
            # a key's minimum (its code 0) times the query's own sum, as the kernel adds it
            qs = split(q[i, h])
            s = (keys[first:n, g] @ qs + keys[first:n, g].min(-1) * (q[i, h].sum(dtype=np.float64) - qs.sum())) \
                * head_dim ** -0.5
            e = np.exp(s - s.max())
            out[i, h] = (e / e.sum()) @ values[first:n, g]
            weighted = np.zeros(n)
            weighted[first:] = e * step[first:n, g]
            blocks = [(weighted[max(b0, first):b0 + BLOCK_SIZE], min(n, b0 + BLOCK_SIZE) - max(b0, first))
                      for b0 in starts]
            bound[i, h] = 255 * SPLIT * sum(count * w.max() for w, count in blocks) / e.sum()
    return out, bound


def read(layer, b, n, keys):
    """What the call's queries read: the first n tokens as the cache holds them, the call's own among
    them (stored before any query attends)."""
    return layer.cached(b, n, keys)


# On tiles the weights and the values are bf16: each unnormalized weight may differ from the rounded
# reference's by one bf16 step (2^-8 of it: the scores agree to f32's precision, not bit for bit), so
# the output by at most 2 * 2^-8 of the largest |value|; against exact attention the rounding itself
# adds as much again.
TILE_STEP = 2 * 2.0 ** -8


# (format, bound on |kiln - exact f32 attention|): u8 codes step at 1/255 of a token's range
@pytest.mark.parametrize("fmt, exact_bound", [(KILN_U8, 0.15), (KILN_F16, 0.01)], ids=["u8", "f16"])
@pytest.mark.parametrize("head_dim, window", [(64, 0), (128, 40), (48, 7)])
def test_the_operation_is_attention_over_what_it_stored(fmt, exact_bound, head_dim, window, tmp_path):
    layer, rng = Layer(fmt, head_dim, window, tmp_path), np.random.default_rng(head_dim + window)
    past, all_k, all_v = [0] * SEQS, [[] for _ in range(SEQS)], [[] for _ in range(SEQS)]
    split_gaps = []
    for counts in CALLS:
        q = [rng.standard_normal((c, HEADS, head_dim)).astype(np.float32) for c in counts]
        k = [2 * rng.standard_normal((c, KV_HEADS, head_dim)).astype(np.float32) for c in counts]
        v = [rng.standard_normal((c, KV_HEADS, head_dim)).astype(np.float32) for c in counts]
        got = layer.call(past, q, k, v)
        for b in range(SEQS):
            all_k[b].append(k[b])
            all_v[b].append(v[b])
            n = past[b] + counts[b]
            seen_k, seen_v = read(layer, b, n, True), read(layer, b, n, False)
            exact = attention(q[b], np.concatenate(all_k[b]), np.concatenate(all_v[b]), past[b], window, head_dim)
            if on_code_words(fmt, head_dim, counts[b]):
                over_cache, bound = over_code_words(q[b], seen_k, seen_v, past[b], window, head_dim)
                assert np.all(np.abs(got[b] - over_cache) <= 1.001 * bound + 2e-5)
                f32 = attention(q[b], seen_k, seen_v, past[b], window, head_dim)
                split_gaps.append(np.abs(got[b] - f32).max())
                assert np.abs(got[b] - exact).max() < exact_bound
            elif on_tiles(head_dim, counts[b]):
                over_cache = attention(q[b], seen_k, seen_v, past[b], window, head_dim, rounded=bf16)
                np.testing.assert_allclose(got[b], over_cache, atol=TILE_STEP * np.abs(seen_v).max() + 1e-5, rtol=0)
                # the tiles ran: bf16's 8 bits leave some of thousands of outputs far from f32's
                f32 = attention(q[b], seen_k, seen_v, past[b], window, head_dim)
                assert np.abs(got[b] - f32).max() > 1e-4
                assert np.abs(got[b] - exact).max() < exact_bound + 2 * TILE_STEP * np.abs(seen_v).max()
            else:
                over_cache = attention(q[b], seen_k, seen_v, past[b], window, head_dim)
                np.testing.assert_allclose(got[b], over_cache, atol=2e-5, rtol=0)
                assert np.abs(got[b] - exact).max() < exact_bound
            past[b] = n
    # the split ran: its rounding leaves some outputs away from f32's
    assert not split_gaps or max(split_gaps) > 2e-5


def test_a_decode_is_the_same_whatever_else_its_call_decodes(tmp_path):
    """Eight sequences decoding together (on code words the op then runs a task per sequence over all
    its kv heads) give bit for bit what they give three at a time (a task per kv head)."""
    seqs, rng = 8, np.random.default_rng(7)
    folders = [tmp_path / "together", tmp_path / "apart"]
    for folder in folders:
        folder.mkdir()
    layers = [Layer(KILN_U8, 64, 0, folder, seqs) for folder in folders]
    prompt = [rng.standard_normal((40 + 3 * b, n, 64)).astype(np.float32) for b in range(seqs)
              for n in (HEADS, KV_HEADS, KV_HEADS)]
    q, k, v = prompt[0::3], [2 * x for x in prompt[1::3]], prompt[2::3]
    for layer in layers:
        layer.call([0] * seqs, q, k, v)
    past = [len(x) for x in q]
    step = [rng.standard_normal((1, n, 64)).astype(np.float32) for _ in range(seqs) for n in (HEADS, KV_HEADS, KV_HEADS)]
    q, k, v = step[0::3], step[1::3], step[2::3]
    together = layers[0].call(past, q, k, v)
    none = [np.zeros((0, n, 64), np.float32) for n in (HEADS, KV_HEADS, KV_HEADS)]
    for group in (range(0, 3), range(3, 6), range(6, 8)):
        pick = lambda xs, i: [xs[b] if b in group else none[i] for b in range(seqs)]   # noqa: E731
        apart = layers[1].call(past, pick(q, 0), pick(k, 1), pick(v, 2))
        for b in group:
            np.testing.assert_array_equal(apart[b], together[b])


@pytest.mark.parametrize("fmt", [KILN_U8, KILN_F16], ids=["u8", "f16"])
def test_a_block_outside_the_pool_is_refused_not_read(fmt, tmp_path):
    layer = Layer(fmt, 64, 0, tmp_path)
    layer.tables[1][0] = 10 ** 6
    x = [np.ones((2, HEADS, 64), np.float32)] * SEQS
    kv = [np.ones((2, KV_HEADS, 64), np.float32)] * SEQS
    with pytest.raises(RuntimeError, match="outside the KV pool"):
        layer.call([0] * SEQS, x, kv, kv)


def test_a_sequence_without_blocks_for_its_tokens_is_refused(tmp_path):
    layer = Layer(KILN_U8, 64, 0, tmp_path)
    x = [np.ones((2, HEADS, 64), np.float32)] * SEQS
    kv = [np.ones((2, KV_HEADS, 64), np.float32)] * SEQS
    with pytest.raises(RuntimeError, match="fewer blocks than"):
        layer.call([40] * SEQS, x, kv, kv, short_of_blocks=1)
