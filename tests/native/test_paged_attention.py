"""kiln.PagedAttention (kiln/kernels/paged_attention.h) in a real ONNX Runtime session,
against a numpy reference written from the definition: each query attends to its row's past tokens
(read through the row's block table from the pool) and the call's new tokens up to itself, with
grouped heads, a sliding window and a score soft-cap where the family has them."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from kiln.engines.ort import native

INPUTS = ("q", "k", "v", "key_cache", "value_cache", "block_tables", "past_lens")




def attention_session(heads: int, kv_heads: int, scale: float, softcap: float = 0.0, window: int = 0,
                      threads: int = 2) -> ort.InferenceSession:
    types = [TensorProto.FLOAT] * 5 + [TensorProto.INT64] * 2
    inputs = [helper.make_tensor_value_info(n, t, None) for n, t in zip(INPUTS, types)]
    attrs = dict(num_heads=heads, kv_num_heads=kv_heads, scale=scale)
    if softcap:
        attrs["softcap"] = softcap
    if window:
        attrs["local_window_size"] = window
    node = helper.make_node("PagedAttention", list(INPUTS), ["out"], domain=native.OP_DOMAIN, **attrs)
    graph = helper.make_graph([node], "paged", inputs, [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(native.OP_DOMAIN, 1)])
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    native.register(opts)
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def reference(q, k, v, key_cache, value_cache, tables, past_lens, heads, kv_heads, scale, softcap=0.0, window=0):
    batch, seq, _ = q.shape
    hd, bs = key_cache.shape[3], key_cache.shape[2]
    group = heads // kv_heads
    out = np.zeros_like(q)
    for b in range(batch):
        past = int(past_lens[b])
        slots = [(tables[b, t // bs], t % bs) for t in range(past)]
        for h in range(heads):
            g = h // group
            past_k = np.array([key_cache[g, blk, off] for blk, off in slots]).reshape(past, hd)
            past_v = np.array([value_cache[g, blk, off] for blk, off in slots]).reshape(past, hd)
            new_k = k[b, :, g * hd:(g + 1) * hd]
            new_v = v[b, :, g * hd:(g + 1) * hd]
            keys, values = np.concatenate([past_k, new_k]), np.concatenate([past_v, new_v])
            for s in range(seq):
                position = past + s
                visible = np.arange(past + seq) <= position
                if window:
                    visible &= position - np.arange(past + seq) < window
                x = scale * (keys @ q[b, s, h * hd:(h + 1) * hd].astype(np.float64))
                if softcap:
                    x = softcap * np.tanh(x / softcap)
                x = np.where(visible, x, -np.inf)
                p = np.exp(x - x.max())
                out[b, s, h * hd:(h + 1) * hd] = (p / p.sum()) @ values
    return out


def make_inputs(rng, batch, seq, heads, kv_heads, hd, past_lens, block_size=4, num_blocks=40):
    max_blocks = max(1, max(-(-p // block_size) for p in past_lens))
    # every row's blocks drawn from a shuffled pool, so a row's blocks are neither adjacent nor in order
    ids = rng.permutation(num_blocks)
    tables = np.zeros((batch, max_blocks), np.int64)
    used = 0
    for b, p in enumerate(past_lens):
        n = -(-p // block_size)
        tables[b, :n] = ids[used:used + n]
        used += n
    f = np.float32
    return dict(q=rng.standard_normal((batch, seq, heads * hd)).astype(f),
                k=rng.standard_normal((batch, seq, kv_heads * hd)).astype(f),
                v=rng.standard_normal((batch, seq, kv_heads * hd)).astype(f),
                key_cache=rng.standard_normal((kv_heads, num_blocks, block_size, hd)).astype(f),
                value_cache=rng.standard_normal((kv_heads, num_blocks, block_size, hd)).astype(f),
                block_tables=tables, past_lens=np.asarray(past_lens, np.int64))


CASES = {
    "one decode": dict(batch=1, seq=1, past=[13]),
    "long decodes across many blocks": dict(batch=2, seq=1, past=[75, 70]),
    "batched decodes, ragged pasts": dict(batch=4, seq=1, past=[0, 5, 17, 32]),
    "first prompts": dict(batch=2, seq=7, past=[0, 0]),
    "chunks that continue their rows": dict(batch=3, seq=20, past=[9, 0, 26]),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("heads,kv_heads,hd", [(4, 4, 16), (9, 3, 64), (4, 2, 20)])
def test_matches_the_definition(library, case, heads, kv_heads, hd):
    rng = np.random.default_rng(len(case) * 7 + heads)
    c = CASES[case]
    feeds = make_inputs(rng, c["batch"], c["seq"], heads, kv_heads, hd, c["past"])
    scale = hd ** -0.5
    got = attention_session(heads, kv_heads, scale).run(None, feeds)[0]
    want = reference(*feeds.values(), heads, kv_heads, scale)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("window,softcap", [(5, 0.0), (0, 2.0), (3, 1.5)])
def test_sliding_window_and_softcap(library, window, softcap):
    rng = np.random.default_rng(window * 10 + int(softcap * 10))
    feeds = make_inputs(rng, 3, 6, 4, 2, 16, [0, 7, 19])
    got = attention_session(4, 2, 0.25, softcap, window).run(None, feeds)[0]
    want = reference(*feeds.values(), 4, 2, 0.25, softcap, window)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_one_thread_and_two_agree_exactly(library):
    """Tasks write disjoint rows, and each is computed the same way whatever thread takes it."""
    feeds = make_inputs(np.random.default_rng(3), 4, 5, 9, 3, 64, [3, 40, 0, 17], num_blocks=64)
    one = attention_session(9, 3, 0.125, threads=1).run(None, feeds)[0]
    two = attention_session(9, 3, 0.125, threads=2).run(None, feeds)[0]
    assert np.array_equal(one, two)


def test_a_block_outside_the_pool_or_a_short_table_is_refused(library):
    feeds = make_inputs(np.random.default_rng(4), 2, 1, 4, 2, 16, [5, 9])
    sess = attention_session(4, 2, 0.25)
    bad = dict(feeds, block_tables=feeds["block_tables"].copy())
    bad["block_tables"][1, 2] = 40                # the pool has 40 blocks: ids 0..39
    with pytest.raises(Exception, match="outside the KV pool"):
        sess.run(None, bad)
    with pytest.raises(Exception, match="longer than its row"):
        sess.run(None, dict(feeds, past_lens=np.array([5, 13], np.int64)))    # 13 tokens need 4 blocks of 4
    with pytest.raises(Exception, match="shapes disagree"):
        sess.run(None, dict(feeds, k=feeds["k"][:, :, :16]))
