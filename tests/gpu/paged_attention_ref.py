"""A numpy reference of com.microsoft PagedAttention (as its schema documents it), run inside ONNX
Runtime CPU as an onnxruntime-extensions Python op, so the ort-cuda graph around the op runs here.

Test double for the CUDA kernel only: the cache is returned as a new output instead of being
updated in place (a Python op cannot alias), and the test engine carries it to the next step.
Python ops take no float16, so q/k/v (already rounded to fp16 by the graph's casts) reach the op
as float32 and the caches are float32 arrays holding fp16 values.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnxruntime_extensions import PyCustomOpDef, onnx_op

DOMAIN = "ai.onnx.contrib"
F32, I32 = PyCustomOpDef.dt_float, PyCustomOpDef.dt_int32


@onnx_op(op_type="PagedAttention", inputs=[F32] * 5 + [I32] * 4, outputs=[F32] * 3,
         attrs={"num_heads": PyCustomOpDef.dt_int64, "kv_num_heads": PyCustomOpDef.dt_int64,
                "scale": PyCustomOpDef.dt_float})
def paged_attention(q, k, v, key_cache, value_cache, cu_seqlens, past, table, slots, num_heads, kv_num_heads, scale):
    nb, bs, kvh, hd = key_cache.shape
    kc, vc = key_cache.copy().reshape(nb * bs, kvh, hd), value_cache.copy().reshape(nb * bs, kvh, hd)
    kc[slots], vc[slots] = k.reshape(-1, kvh, hd), v.reshape(-1, kvh, hd)
    q = q.reshape(-1, num_heads, hd).astype(np.float32)
    out = np.zeros_like(q)
    group = num_heads // kv_num_heads
    for b in range(len(past)):
        lo, hi = cu_seqlens[b], cu_seqlens[b + 1]
        total = past[b] + hi - lo
        positions = np.arange(total)
        keys_at = table[b][positions // bs] * bs + positions % bs
        keys, values = kc[keys_at].astype(np.float32), vc[keys_at].astype(np.float32)    # [total, kvh, hd]
        for i in range(hi - lo):
            visible = past[b] + i + 1                                                        # causal, bottom-right
            for h in range(num_heads):
                s = keys[:visible, h // group] @ q[lo + i, h] * scale
                p = np.exp(s - s.max())
                out[lo + i, h] = (p / p.sum()) @ values[:visible, h // group]
    out = out.reshape(len(out), -1).astype(np.float16).astype(np.float32)      # the op's fp16 output
    return out, kc.reshape(key_cache.shape), vc.reshape(value_cache.shape)


def with_reference_op(model: onnx.ModelProto) -> onnx.ModelProto:
    """The ort-cuda graph with each PagedAttention node moved to the Python op (its 9 used inputs,
    q/k/v cast up to float32) and the caches typed float32."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    nodes = []
    for n in out.graph.node:
        if n.op_type == "PagedAttention":
            used = [i for i in n.input if i]
            for j in range(3):
                nodes.append(onnx.helper.make_node("Cast", [used[j]], [used[j] + "/f32"], to=onnx.TensorProto.FLOAT))
                used[j] += "/f32"
            n.domain = DOMAIN
            del n.input[:]
            n.input.extend(used)
        nodes.append(n)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    for v in [*out.graph.input, *out.graph.output]:
        if "_cache" in v.name:
            v.type.tensor_type.elem_type = onnx.TensorProto.FLOAT
    out.opset_import.append(onnx.helper.make_opsetid(DOMAIN, 1))
    return out
