"""Weight precision of an engine: a flag stored in the manifest by value, read by every layer."""

from __future__ import annotations

import enum


class QuantMode(enum.Enum):
    """Weight precision of an engine; stored in the manifest by value."""

    NONE = "none"
    INT8 = "int8"          # int8 weights; activations at MatMulNBits' block-wise int8 (W8A16-like)
    INT4 = "int4"
    W8A8 = "w8a8"          # int8 weights and int8 activations per call: faster, less exact
    F16 = "f16"            # 16-bit float weights, computed as the backend computes (f32 on openvino)

    @property
    def bits(self) -> int | None:
        return {QuantMode.NONE: None, QuantMode.INT8: 8, QuantMode.INT4: 4, QuantMode.W8A8: 8, QuantMode.F16: 16}[self]
