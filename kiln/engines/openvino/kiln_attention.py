"""kiln's own paged attention in the OpenVINO graph: kiln.PagedAttentionU8 and kiln.PagedAttentionF16
(the extension library's kiln/engines/openvino/native/paged_attention_op.cpp; arithmetic in
kiln/kernels/paged_kv_attention.cc).

They take the packed tokens and the sequence inputs OpenVINO's PagedAttentionExtension takes (the
engine feeds both alike), over a cache in kiln's layout (kiln/kernels/paged_kv_attention.h): per
layer, keys and values [blocks, kv_heads, block_size, row bytes] u8, whose (block, kv head) segments
hold the keys transposed and the values by token, as u8 codes with a scale and a minimum per token
and head (KILN_U8) or as f16 (KILN_F16). Why its own: the plugin's operation over a compressed cache
spends much of a batched decode step on fixed costs at short contexts and on dequantizing at long
ones; these read each block once per kv head for every query head of the group (GQA) and compute
in f32, the softmax running as the blocks come.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import openvino as ov

from kiln.contract.model_spec import ModelSpec
from kiln.engines.openvino.native.stand_in import stand_in

BLOCK_SIZE = 32              # tokens per cache block (the plugin's own u8 block, so pools size alike)


@dataclass(frozen=True)
class CacheFormat:
    name: str                # OpenVinoOptions.attention's value
    operation: str           # the library's operation
    row_extra: int           # bytes a token's row holds past its elements (u8: scale and minimum)
    element_bytes: int

    def row_bytes(self, head_dim: int) -> int:
        return head_dim * self.element_bytes + self.row_extra


KILN_U8 = CacheFormat("kiln-u8", "PagedAttentionU8", row_extra=8, element_bytes=1)
KILN_F16 = CacheFormat("kiln-f16", "PagedAttentionF16", row_extra=0, element_bytes=2)
FORMATS = {f.name: f for f in (KILN_U8, KILN_F16)}


def cache_format(attention: str) -> CacheFormat:
    try:
        return FORMATS[attention]
    except KeyError:
        raise ValueError(f"no attention {attention!r} in the openvino backend (the plugin's, or one of "
                         f"{', '.join(FORMATS)})") from None


def supports(spec: ModelSpec) -> str:
    """Empty where the operations run this model; otherwise why not."""
    if spec.head_dim % 16 or spec.head_dim > 256:
        return f"a head of {spec.head_dim} values (kiln's attention takes multiples of 16 up to 256)"
    if spec.num_heads % spec.num_kv_heads:
        return "query heads that are not a multiple of the kv heads"
    return ""


def cache_parameter(name: str, spec: ModelSpec, fmt: CacheFormat):
    from openvino import opset13 as ops

    shape = [-1, spec.num_kv_heads, BLOCK_SIZE, fmt.row_bytes(spec.head_dim)]
    param = ops.parameter(ov.PartialShape(shape), ov.Type.u8, name=name)
    param.output(0).get_tensor().set_names({name})
    return param


# The library's operations' stand-ins (one class each): their output is q's shape.
STAND_INS = {f.name: stand_in(f.operation, lambda node: node.get_input_partial_shape(0)) for f in FORMATS.values()}


def operation(fmt: CacheFormat, inputs: list) -> ov.Node:
    """The node of `fmt`'s operation over `inputs` (attention_inputs), as a stand-in
    (with_library_operations puts the library's in its place)."""
    return STAND_INS[fmt.name](inputs)


def with_library_operations(core: ov.Core, model: ov.Model) -> ov.Model:
    """The model with the library's operations where the graph holds the Python stand-ins: a Core
    reads only a saved model's operations through an extension (the plugin cannot run a stand-in).
    `core` must have kiln's library."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory(prefix="kiln-ov-attention-") as tmp:
        path = Path(tmp) / "paged.xml"
        ov.save_model(model, path, compress_to_fp16=False)
        # NOTE: read_model may map paged.bin; the mapping outlives the file's removal
        return core.read_model(path)


def attention_inputs(q, k, v, key_cache, value_cache, seq: dict, scale: float, window: int,
                     softcap: float = 0.0) -> list:
    from openvino import opset13 as ops

    inputs = [q, k, v, key_cache, value_cache, seq["past_lens"], seq["subsequence_begins"], seq["block_indices"],
              seq["block_indices_begins"], ops.constant(np.float32(scale)), ops.constant(np.int32(window)),
              ops.constant(np.float32(softcap))]
    return [x.output(0) if hasattr(x, "output") else x for x in inputs]


def dequantize_block(cache: np.ndarray, block: int, head_dim: int, keys: bool, fmt: CacheFormat = KILN_U8) -> np.ndarray:
    """One block of a cache [blocks, kv_heads, block_size, row bytes] u8 -> the values it holds,
    [kv_heads, block_size, head_dim] f32 (kiln/kernels/paged_kv_attention.h's layout; for checks)."""
    kvh, bs = cache.shape[1], cache.shape[2]
    segments = cache[block].reshape(kvh, -1)
    n = head_dim * bs * fmt.element_bytes
    elements = np.ascontiguousarray(segments[:, :n]).view(np.float16 if fmt is KILN_F16 else np.uint8)
    if fmt is KILN_F16:         # keys [hd][bs], values [bs][hd]
        return (elements.reshape(kvh, head_dim, bs).transpose(0, 2, 1) if keys
                else elements.reshape(kvh, bs, head_dim)).astype(np.float32)
    # u8 words of four: keys [hd/4][bs][4] (4 dimensions of a key), values [bs/4][hd][4] (4 keys)
    elements = (elements.reshape(kvh, head_dim // 4, bs, 4).transpose(0, 2, 1, 3) if keys
                else elements.reshape(kvh, bs // 4, head_dim, 4).transpose(0, 1, 3, 2)).reshape(kvh, bs, head_dim)
    elements = elements.astype(np.float32)
    params = np.ascontiguousarray(segments[:, n:]).view(np.float32).reshape(kvh, 2, bs)
    return elements * params[:, 0, :, None] + params[:, 1, :, None]
